"""Files: qcore safetensors files, streaming safetensors, checkpoints (files, folders, indexes), storage."""
