"""dlrm-cxl: a DLRM trainer whose embedding tables live in a persistent memory pool."""
