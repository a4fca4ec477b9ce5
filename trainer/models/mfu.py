"""Model FLOPs utilisation: the FLOPs a model's tokens need (``ModelSpec.flops_per_token``) per second,
over the device's peak.

    mfu(tokens_per_s_per_device, spec.flops_per_token(seq_len), device_peak_flops(device))
"""

from __future__ import annotations

import torch

# Dense (no sparsity) bfloat16 tensor-core peaks from NVIDIA's datasheets, FLOP/s. The first pattern
# that the device name contains wins, so the longer names come first.
_PEAK_BF16 = (("H100 PCIe", 756e12), ("H100 NVL", 835e12), ("H100", 989e12), ("H200 NVL", 835e12),
              ("H200", 989e12), ("GH200", 989e12), ("B200", 2250e12), ("A100", 312e12), ("L40S", 362e12),
              ("L4", 121e12))


def device_peak_flops(device: torch.device, name: str | None = None) -> float | None:
    """Dense bfloat16 peak of a CUDA device (None on CPU or an unknown GPU: MFU is then not reported).

    Args:
        device: the training device.
        name: the device's name (default: ``torch.cuda.get_device_name(device)``).
    """
    if device.type != "cuda":
        return None
    name = name or torch.cuda.get_device_name(device)
    return next((peak for pattern, peak in _PEAK_BF16 if pattern in name), None)


def mfu(tokens_per_s: float, flops_per_token: float, peak_flops: float | None) -> float | None:
    """Achieved over peak FLOP/s, for one device's tokens per second (None without a known peak)."""
    return tokens_per_s * flops_per_token / peak_flops if peak_flops else None
