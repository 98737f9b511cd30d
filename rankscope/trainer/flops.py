"""Model FLOPs utilisation (MFU).

Convention: PaLM's model FLOPs per token, 6N + 12*L*H*Q*T (N parameters, L layers, H heads,
Q head size, T sequence length), i.e. the attention term counted for the full T x T score
matrix, as nanoGPT and torchtitan do. Megatron and llm.c halve that term for the causal mask;
so this MFU reads slightly higher than theirs at long sequences. Recomputation is not counted.
"""

from __future__ import annotations

from rankscope.trainer.model import ModelArgs, count_parameters

# Dense bf16 peak FLOP/s, matched against torch.cuda.get_device_name() in order.
_PEAKS: tuple[tuple[tuple[str, ...], float], ...] = (
    (("H200",), 989e12),
    (("H100", "PCIE"), 756e12),
    (("H100",), 989e12),
    (("A100",), 312e12),
)


def flops_per_token(args: ModelArgs) -> float:
    """Training FLOPs (forward and backward) per token of the whole model."""
    return 6 * count_parameters(args) + 12 * args.layers * args.heads * args.head_dim * args.seq


def peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak of one device, or None when the device is unknown (then no MFU is reported)."""
    name = device_name.upper()
    for words, peak in _PEAKS:
        if all(w in name for w in words):
            return peak
    return None


def mfu(tokens_per_s: float, args: ModelArgs, num_devices: int, peak_per_device: float | None) -> float | None:
    """Achieved model FLOP/s over the peak of all devices; None without a known peak."""
    if peak_per_device is None:
        return None
    return tokens_per_s * flops_per_token(args) / (num_devices * peak_per_device)
