"""CuTeDSL kernels for Hopper (sm_90a). Installed as ``dsv4_attn.kernels``, never as ``kernels``."""
