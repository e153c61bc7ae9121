"""3-D M-RoPE positions of one generated row (the inputs of ``verify``, the tests and bench/):
text advances t/h/w; a visual run takes (start + t, start + row, start + col) on the merged grid.
Models may not import the data side's M-RoPE (``energon_tasks``); this one covers the step-1
temporal positions these inputs need."""

from __future__ import annotations

import torch


def mrope_positions(input_ids: torch.Tensor, grids: list[torch.Tensor], vision_ids: set[int],
                    merge: int) -> torch.Tensor:
    """(3, 1, L) M-RoPE positions of one row: text advances t/h/w; a visual run takes
    (start + t, start + row, start + col) on the merged grid; text resumes at max + 1."""
    ids, out, pos, k, i = input_ids.tolist(), [], 0, 0, 0
    while i < len(ids):
        if ids[i] in vision_ids:
            t, h, w = (int(x) for x in grids[k])
            h, w = h // merge, w // merge
            tt, hh, ww = torch.meshgrid(torch.arange(t), torch.arange(h), torch.arange(w),
                                        indexing="ij")
            out.append(torch.stack([tt.flatten(), hh.flatten(), ww.flatten()]) + pos)
            pos = int(out[-1].max()) + 1
            i, k = i + t * h * w, k + 1
        else:
            out.append(torch.full((3, 1), pos))
            pos, i = pos + 1, i + 1
    return torch.cat(out, dim=1)[:, None, :]
