"""A plain training loop with the sparsity engine, under FSDP2 (``fully_shard``) or in one process.

    torchrun --nproc_per_node 2 tests/scripts/fsdp2_loop.py OUT       # FSDP2 on CPU (gloo)
    python tests/scripts/fsdp2_loop.py OUT                            # the single-process reference

Schedule: 50% random masks, prune to 80% after step 2, densify after step 4, 6 steps.
After every step each rank checks, on its own shards, that masked weights and AdamW
moments are exactly 0. Rank 0 writes a consolidated checkpoint at step 3 (masks +
gathered weights) and ``result.json``.
"""

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.tensor import DTensor, Shard  # noqa: E402

from hf_sparsity import SparsityConfig, SparsityEngine  # noqa: E402
from tests.conftest import tiny_model  # noqa: E402
from tests.trainer_utils import end_process_group  # noqa: E402

STEPS = 6


def _is_dtensor(t):
    return isinstance(t, DTensor)


def _local(t):
    return t.to_local() if isinstance(t, DTensor) else t


def _local_slice(mask, p):
    """This rank's part of ``mask``, computed independently of the engine: FSDP2 shards dim 0 like
    ``torch.chunk`` over the mesh (the last ranks may hold fewer rows, or none)."""
    if not isinstance(p, DTensor):
        return mask
    (placement,) = p.placements
    assert isinstance(placement, Shard), placement
    chunks = torch.chunk(mask, p.device_mesh.size(), dim=placement.dim)
    rank = p.device_mesh.get_local_rank()
    part = chunks[rank] if rank < len(chunks) else mask.narrow(placement.dim, 0, 0)
    assert tuple(part.shape) == tuple(p.to_local().shape), (part.shape, p.to_local().shape)
    return part


def check_local(engine, opt):
    """Masked weights and optimizer moments are 0 on this rank's shards; returns tensors checked."""
    n = 0
    for name, mask in engine.masks.items():
        p = engine.model.get_parameter(name)
        local_mask = _local_slice(mask, p)
        off = local_mask == 0
        assert torch.count_nonzero(_local(p).detach()[off]) == 0, f"{name}: masked weight revived"
        for k, v in opt.state.get(p, {}).items():
            if torch.is_tensor(v) and v.shape == p.shape:
                assert torch.count_nonzero(_local(v)[off]) == 0, f"{name}: {k} nonzero where masked"
        n += 1
    return n


def full_state(model):
    return {
        n: (p.full_tensor() if _is_dtensor(p) else p).detach().clone() for n, p in model.named_parameters()
    }


def main(out):
    distributed = "RANK" in os.environ
    rank, world = 0, 1
    if distributed:
        dist.init_process_group("gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = tiny_model("llama", layers=2, hidden=64)
    cfg = SparsityConfig(
        sparsity=0.5, init_method="random", seed=7,
        schedule=[{"step": 2, "sparsity": 0.8}, {"step": 4, "densify": True}],
    )  # fmt: skip
    engine = SparsityEngine(model, cfg, total_steps=STEPS)
    engine.build_masks()
    engine.apply()
    sharded = False
    if distributed:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        engine.refresh()
        sharded = any(_is_dtensor(model.get_parameter(n)) for n in engine.masks)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    engine.attach(opt)
    g = torch.Generator().manual_seed(123)
    checked, levels, densify_zero_ok = [], {}, None
    for step in range(1, STEPS + 1):
        x = torch.randint(2, 128, (8, 16), generator=g)
        xb = x[rank::world]  # each rank its half; the averaged gradient is the full batch's
        model(input_ids=xb, labels=xb).loss.backward()
        before = {n: m.clone() for n, m in engine.masks.items()}
        opt.step()
        opt.zero_grad()
        checked.append(check_local(engine, opt))
        levels[step] = sorted({round(v, 4) for v in engine.levels.values()})
        if step == 3:
            weights = full_state(model)  # a collective: every rank
            if rank == 0:
                ckpt = os.path.join(out, "checkpoint-3")
                os.makedirs(ckpt, exist_ok=True)
                engine.save(ckpt)
                from safetensors.torch import save_file

                save_file(
                    {k: v.contiguous() for k, v in weights.items()}, os.path.join(ckpt, "model.safetensors")
                )
        if step == 4:  # densified now: previously masked weights are exactly 0 when dense training starts
            weights = full_state(model)
            densify_zero_ok = all(torch.count_nonzero(weights[n][m == 0]) == 0 for n, m in before.items())
    final = full_state(model)
    if rank == 0:
        with open(os.path.join(out, f"result_{'fsdp' if distributed else 'single'}.json"), "w") as f:
            json.dump(
                {
                    "world": world,
                    "sharded": sharded,
                    "checked_per_step": checked,
                    "levels": levels,
                    "events": [e["kind"] for e in engine.events],
                    "masks_after_densify": len(engine.masks),
                    "densify_zero_ok": densify_zero_ok,
                    "final_nonzero_fraction": float(
                        sum(int((final[n] != 0).sum()) for n in engine.targets)
                        / sum(final[n].numel() for n in engine.targets)
                    ),
                },
                f,
            )
    end_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
