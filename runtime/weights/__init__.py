"""Policy weights on their way from the trainer to the generators: the version index in
TorchStore, its byte layout, and the direct paths (CUDA IPC, NCCL push)."""
