"""The environment of a tensor-parallel benchmark, set before torch or NCCL is imported (no import of torch here)."""

# NVLink multicast off (shared GPUs): set before torch and NCCL are imported or initialised.
MULTICAST_OFF = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
