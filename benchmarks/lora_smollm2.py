"""LoRA on SmolLM2-135M at 50% (topk masks): cost and quality of `lora: masked` vs `merge_then_mask`.

Produces the figures of docs/results/lora_smollm2.md. Each mode trains in its own process (so its peak
memory is its own); a last phase times both modes' training steps interleaved in one
process. Everything is CPU and offline::

    python benchmarks/lora_smollm2.py --model $S/topk50 \
        --data DATA_DIR/corpus/openwebtext-1000.jsonl --out $OUT

``$S/topk50`` is the folder ``eval/prepare_smollm2.py`` writes (SmolLM2-135M with 50% topk masks).

Writes OUT/results.json (and prints it).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import resource
import statistics
import subprocess
import sys
import time

import torch

MODES = ("masked", "merge_then_mask")


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def blocks(path, tokenizer, seq_len, first_doc, n_docs):
    ids: list[int] = []
    with open(path, encoding="utf-8") as f:
        docs = [json.loads(line)["text"] for line in f][first_doc : first_doc + n_docs]
    for d in docs:
        ids += tokenizer(d)["input_ids"] + [tokenizer.eos_token_id]
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len]).view(n, seq_len)


@torch.no_grad()
def perplexity(model, data, batch=4) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(data), batch):
        x = data[i : i + batch]
        out = model(input_ids=x, labels=x)
        n = x.numel() - x.shape[0]
        total += float(out.loss) * n
        count += n
    return math.exp(total / count)


def target_sparsity(model, names) -> float:
    z = n = 0
    for name in names:
        w = model.get_parameter(name).detach()
        z += int((w == 0).sum())
        n += w.numel()
    return z / n


def lora_config(r):
    import peft

    return peft.LoraConfig(
        r=r,
        lora_alpha=2 * r,
        lora_dropout=0.0,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        task_type="CAUSAL_LM",
    )


def train_one(args) -> dict:
    import peft
    from transformers import AutoTokenizer, Trainer, TrainerCallback, TrainingArguments

    from hf_sparsity import SparsityCallback, SparsityConfig, load_sparse_model, merge_sparse
    from hf_sparsity.data import BlockDataset

    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(args.model)
    train = blocks(args.data, tok, args.seq_len, 0, args.train_docs)
    held = blocks(args.data, tok, args.seq_len, 1000 - args.eval_docs, args.eval_docs)[: args.eval_blocks]
    model, _ = load_sparse_model(args.model, dtype=torch.float32)  # masks applied: exact zeros
    cfg = SparsityConfig(sparsity=0.5, init_method="topk", lora=args.mode)
    res = {"mode": args.mode, "train_tokens": args.steps * args.batch * args.seq_len}
    if args.mode == MODES[0]:
        t = time.perf_counter()
        res["ppl_base"] = perplexity(model, held)
        res["eval_s"] = time.perf_counter() - t
    base_before = {n: p.detach().clone() for n, p in model.named_parameters()}
    model = peft.get_peft_model(model, lora_config(args.r))
    cb = SparsityCallback(cfg)

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.times, self._t = [], None

        def on_step_begin(self, *a, **k):
            self._t = time.perf_counter()

        def on_step_end(self, *a, **k):
            self.times.append(time.perf_counter() - self._t)

    timer = StepTimer()
    targs = TrainingArguments(
        output_dir=os.path.join(args.out, f"trainer-{args.mode}"),
        max_steps=args.steps,
        per_device_train_batch_size=args.batch,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        logging_steps=5,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    trainer = Trainer(
        model=model, args=targs, train_dataset=BlockDataset(train.tolist()), callbacks=[cb, timer]
    )
    rss0 = rss_mb()
    out = trainer.train()
    res["peak_rss_over_start_mb"] = peak_rss_mb() - rss0
    res["train_loss"] = out.training_loss
    res["losses"] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    res["step_s_median"] = statistics.median(timer.times[2:] or timer.times)
    res["restored_from"] = cb.restored_from
    names = list(cb.engine.masks)
    view = cb.engine.model
    res["base_untouched"] = all(torch.equal(p.detach(), base_before[n]) for n, p in view.named_parameters())
    res["sparsity_adapter_base"] = target_sparsity(view, names)
    res["lora_B_abs_mean"] = statistics.mean(
        float(p.detach().abs().mean()) for n, p in model.named_parameters() if "lora_B" in n
    )
    res["ppl_adapter"] = perplexity(model, held)
    # What a plain peft merge gives (a copy, so the real merge below starts from the same adapter).
    plain = copy.deepcopy(model).merge_and_unload()
    res["sparsity_plain_merge"] = target_sparsity(plain, names)
    if args.mode == "merge_then_mask":  # in masked mode peft's merge is already the masked one
        res["ppl_plain_merge"] = perplexity(plain, held)
    del plain
    merged = merge_sparse(model, output_dir=os.path.join(args.out, f"merged-{args.mode}"), overwrite=True)
    res["sparsity_merge_sparse"] = target_sparsity(merged, names)
    res["ppl_merge_sparse"] = perplexity(merged, held)
    return res


def timing(args) -> dict:
    """Both modes' training steps, interleaved in one process (same load for both)."""
    import peft
    from transformers import AutoModelForCausalLM

    from hf_sparsity import SparsityConfig, SparsityEngine

    x = torch.randint(0, 49152, (args.batch, args.seq_len), generator=torch.Generator().manual_seed(0))
    runs = {}
    for mode in MODES:
        m = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(args.model), lora_config(args.r))
        eng = SparsityEngine(m, SparsityConfig(sparsity=0.5, init_method="topk", lora=mode))
        eng.restore(args.model)
        opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-4)
        eng.attach(opt)
        m.train()
        runs[mode] = (m, opt)
    times = {mode: [] for mode in MODES}
    for rep in range(args.timing_reps + 1):
        for mode in MODES if rep % 2 == 0 else MODES[::-1]:
            m, opt = runs[mode]
            t = time.perf_counter()
            m(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if rep:  # the first round warms up
                times[mode].append(time.perf_counter() - t)
    return {mode: statistics.median(v) for mode, v in times.items()} | {"reps": args.timing_reps}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True, help="sparse model folder, e.g. prepare_smollm2.py's topk50/")
    p.add_argument(
        "--data", required=True, help="a .jsonl of documents, e.g. DATA_DIR/corpus/openwebtext-1000.jsonl"
    )
    p.add_argument("--out", required=True, help="output folder for results.json")
    p.add_argument("--mode", choices=(*MODES, "timing"))
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--r", type=int, default=16)
    p.add_argument("--train-docs", type=int, default=200)
    p.add_argument("--eval-docs", type=int, default=40)
    p.add_argument("--eval-blocks", type=int, default=32)
    p.add_argument("--timing-reps", type=int, default=5)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    os.makedirs(args.out, exist_ok=True)
    if args.mode in MODES:
        print(json.dumps(train_one(args)))
        return
    if args.mode == "timing":
        print(json.dumps(timing(args)))
        return
    results = {"args": vars(args), "load_before": os.getloadavg()}
    # Both modes train at once, one process each (same machine load for both; own peak memory each).
    procs = {}
    for mode in MODES:
        cmd = [sys.executable, __file__, *sys.argv[1:], "--mode", mode]
        log = open(os.path.join(args.out, f"{mode}.log"), "w")
        procs[mode] = (
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, text=True),
            time.perf_counter(),
        )
    for mode, (proc, t) in procs.items():
        out, _ = proc.communicate()
        if proc.returncode:
            raise SystemExit(f"{mode} failed; see {args.out}/{mode}.log")
        results[mode] = json.loads(out.strip().splitlines()[-1])
        results[mode]["wall_s"] = time.perf_counter() - t
    results["load_after"] = os.getloadavg()
    if args.timing_reps:
        proc = subprocess.run(
            [sys.executable, __file__, *sys.argv[1:], "--mode", "timing"], capture_output=True, text=True
        )
        results["timing"] = (
            json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else proc.stderr[-2000:]
        )
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
