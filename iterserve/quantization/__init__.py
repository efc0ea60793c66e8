"""Quantized weights: kept in their blocks and multiplied as they are stored."""
