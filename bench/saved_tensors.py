"""What one micro-batch's forward saves for backward, tensor by tensor, on a device: the figures behind the
planner's activation model (docs/design/memory.md, "Memory model"), to tell where a device's kernels save other
tensors than the CPU's (flash attention, fused norms).

Builds the trainer's own stage (runtime/model/transformer.build_stage) of a Llama-style model, runs one forward
under the trainer's autocast and lists each storage autograd saves (first save counted, as
runtime/observe/memory_meter does) by the module that saved it, then the total against the planner's per-layer
and head figures.

    python bench/saved_tensors.py [--device cuda] [--layers 2] [--hidden 2048] [--seq 2048] [--micro-batch 2]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--ffn", type=int, default=5632)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=2)
    ap.add_argument("--precision", default="bf16")
    ap.add_argument("--recompute", default="none")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()

    import torch

    from trainctl.model_shape import ModelShape
    from trainctl.plan.memory import trainer_head_activation_bytes, trainer_layer_activation_bytes
    from trainctl.runtime.model.transformer import build_stage, loss_fn
    from trainctl.runtime.parallel.tensor_parallel import TPContext
    from trainctl.spec.models import ModelSpec

    spec = ModelSpec(layers=a.layers, hidden=a.hidden, heads=a.heads, kv_heads=a.kv_heads, ffn_hidden=a.ffn,
                     vocab=a.vocab, seq_len=a.seq, activation="swiglu", norm="rmsnorm", position="rope",
                     tied_embeddings=False, bias=False)
    cfg = ModelShape.from_spec(spec)
    device = torch.device(a.device)
    model = build_stage(cfg, range(cfg.layers), first=True, last=True, seed=1234, recompute=a.recompute, device=device)
    x = torch.randint(0, a.vocab, (a.micro_batch, a.seq), device=device)
    current = ["-"]
    for name, mod in model.named_modules():
        mod.register_forward_pre_hook(lambda m, args, n=name: current.__setitem__(0, n or "model"))
    # autocast's 16-bit copies of the weights are saved too (a matmul's backward needs its weight): told apart
    # from an activation of the same shape by their values
    params = list(model.parameters())

    def weight_cast(t: torch.Tensor) -> bool:
        return t.dim() == 2 and any(q.shape == t.shape and torch.equal(q.to(t.dtype), t)
                                    for p in params for q in (p, p.t()) if q.dim() == 2)

    seen: set[tuple[int, int]] = set()
    by_where: dict[tuple[str, tuple[int, ...], str], list[int]] = defaultdict(lambda: [0, 0])

    def pack(t: torch.Tensor) -> torch.Tensor:
        if isinstance(t, torch.nn.Parameter) or isinstance(t._base, torch.nn.Parameter):
            return t
        s = t.untyped_storage()
        key = (s.data_ptr(), s.nbytes())
        if key not in seen and key[1]:
            seen.add(key)
            where = ".".join(p for p in current[0].split(".") if not p.isdigit()) or current[0]
            if weight_cast(t):
                where += " (weight cast)"
            row = by_where[(where, tuple(t.shape), str(t.dtype).replace("torch.", ""))]
            row[0] += 1
            row[1] += key[1]
        return t

    amp = a.precision in ("bf16", "fp16")
    dtype = torch.bfloat16 if a.precision == "bf16" else torch.float16
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            torch.autocast(device.type, dtype=dtype, enabled=amp):
        loss = loss_fn(model(x), x, cfg, TPContext.single())
    total = sum(b for _, b in by_where.values())
    casts = sum(b for (w, _, _), (_, b) in by_where.items() if w.endswith("(weight cast)"))
    rows = sorted(((w, s, d, n, b) for (w, s, d), (n, b) in by_where.items()), key=lambda r: -r[4])
    print(f"device {device} ({torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}), torch "
          f"{torch.__version__}; {a.layers} layers, h {a.hidden}, seq {a.seq}, micro-batch {a.micro_batch}, "
          f"{a.precision}, recompute {a.recompute}")
    print(f"{'module (layers merged)':40} {'shape':28} {'dtype':9} {'count':>5} {'MB':>10}")
    for w, s, d, n, b in rows:
        print(f"{w:40} {str(list(s)):28} {d:9} {n:5} {b / 1e6:10.2f}")
    on_gpu = device.type == "cuda"
    layer = trainer_layer_activation_bytes(cfg, a.micro_batch, 1, False, a.recompute, a.precision, on_gpu=on_gpu)
    head = trainer_head_activation_bytes(cfg, a.micro_batch, 1, False, cfg.vocab, a.precision, on_gpu=on_gpu)
    planned = a.layers * layer + head
    acts = total - casts
    print(f"saved {total / 1e6:.1f} MB, of which weight casts {casts / 1e6:.1f} MB; the rest {acts / 1e6:.1f} MB; "
          f"planner: {a.layers} x {layer / 1e6:.1f} MB per layer + head {head / 1e6:.1f} MB = {planned / 1e6:.1f} MB "
          f"({planned / acts - 1:+.1%} of the rest)")
    if a.json:
        a.json.write_text(json.dumps({"device": str(device), "saved_bytes": total, "weight_cast_bytes": casts,
                                      "planned_bytes": planned,
                                      "rows": [[w, list(s), d, n, b] for w, s, d, n, b in rows]}, indent=1))
    loss.backward()


if __name__ == "__main__":
    main()
