"""Attention kernels; each op has a plain-torch reference the fast kernels are tested against."""
