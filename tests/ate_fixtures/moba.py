"""The stand-in agent's fixed edit for feat_moba (a test fixture, not part of PithTrain): MoBA-style
block-sparse causal attention, written with masks over the whole score matrix."""

import torch
import torch.nn.functional as F


def moba_attention(q, k, v, block_size: int, top_k: int, scale: float):
    B, H, S, D = q.shape
    blocks = -(-S // block_size)
    padded = F.pad(k, (0, 0, 0, blocks * block_size - S))
    means = padded.view(B, H, blocks, block_size, D).mean(3)  # only earlier (full) blocks are gated
    pos = torch.arange(S, device=q.device)
    q_block, k_block = pos // block_size, pos // block_size
    earlier = torch.arange(blocks, device=q.device)[None, :] < q_block[:, None]  # [S, blocks]
    gate = (q @ means.transpose(-1, -2)).masked_fill(~earlier, float("-inf"))
    chosen = torch.zeros_like(gate, dtype=torch.bool).scatter_(-1, gate.topk(min(top_k, blocks), -1).indices, True) & earlier
    allowed = chosen.gather(-1, k_block.expand(B, H, S, S)) | ((k_block[None, :] == q_block[:, None]) & (pos[None, :] <= pos[:, None]))
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, -1) @ v
