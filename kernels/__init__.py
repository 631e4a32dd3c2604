"""Triton kernels (installed as ``laminar_mcore.kernels``): fused vocab-parallel log-prob and
decoupled-PPO loss, sequence packing. Each kernel has a torch reference of the same signature;
CUDA dispatches to Triton, CPU to the chunked torch path. The Triton entry points refuse host
tensors unless ``TRITON_INTERPRET=1`` runs Triton's interpreter (``_device.check_devices``)."""
