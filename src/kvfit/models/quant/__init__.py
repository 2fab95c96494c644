"""FP8 layers: linears (linear.py) and the mixture-of-experts experts (experts.py). The math, the reference and the
GEMMs they run are kernels' (kvfit.kernels: fp8.py, fp8_gemm.py and the Triton fp8_* kernels); the scheme itself
is read from config.json by kvfit.quant_scheme."""
