"""The model: layers, weights, RoPE, quantized linear ops."""
