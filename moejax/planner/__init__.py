"""The topology-aware planner: per-GPU memory, bytes per link class and step time of a layout, before any
run (`moejax-plan`), and the same numbers next to XLA's for a compiled dry run (`moejax-train --dry_run`)."""
