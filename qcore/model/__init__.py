"""Whole-model runs: recipes, the quantize/dequantize pipeline, exports, distributed runs."""
