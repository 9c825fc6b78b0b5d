"""Custom ops in the `dspark` namespace: Triton kernels on CUDA, plain torch on CPU, each
registered with torch.library so torch.compile traces it and CUDA graphs capture it."""
