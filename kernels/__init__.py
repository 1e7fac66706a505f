"""Device kernels behind small functions, each with a plain-torch reference.

Nothing here imports engine code. CPU paths are plain torch; CUDA paths (FlashInfer, Triton) are
chosen at call time and tested on the GPU machine against the references in this package.
"""
