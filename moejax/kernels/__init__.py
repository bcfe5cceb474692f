"""The hot-path kernels and which one runs where: attention (`attention.py`), the experts' grouped GEMM
(`grouped_gemm.py`), the LM head + cross-entropy (`cross_entropy.py`), and the choice of each from the config
and the platform of the mesh's devices (`resolve.py`). Below `parallel` and `model`: kernels know arrays, not
meshes or modules."""
