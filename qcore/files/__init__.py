"""Files, lowest module first: paths (checks, atomic writes), stfile (safetensors), checkpoint
(sources, index files, OUT != IN, what a format reads), io (qcore's safetensors files), hfconfig
(config.json's quantization_config), storage (fsspec URLs)."""
