"""FP8 weights: the math and reference (fp8.py), the GEMMs (gemm.py, block_gemm.py), the layers (linear.py) and
the mixture-of-experts experts (experts.py). The scheme itself is read from config.json by kvfit.quant_scheme."""
