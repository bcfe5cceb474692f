"""The one base class of every error that means "bad configuration or input", wherever it is found.

Each package raises its own subclass (ConfigError, DataError, CheckpointError, TopologyError, ...) with one
sentence saying what is wrong and what to change. Entry points catch `InputError` alone: `moejax-train`
prints the message and exits 2 with nothing in WORKDIR overwritten; the Python API (`moejax.train`) lets it
propagate.
"""


class InputError(Exception):
    """A configuration or input the run cannot use; the message is shown to the user as is."""
