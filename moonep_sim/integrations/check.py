"""The expert-parallel model against the single-process model: same seed, same data, same steps.

Data: step ``i`` of a run with seed ``s`` trains on a global batch of ``R * batch`` random token
sequences of length ``seq`` (:func:`global_batch`); rank r takes sequences ``[r*batch,
(r+1)*batch)``. The loss is the causal LM loss of the model (mean over the shard's positions), so
with equal shards the mean of the ranks' losses is the loss of the whole batch.

:func:`check_training` runs, on every rank, K steps of the expert-parallel model (plain SGD, the
DDP convention of :meth:`~moonep_sim.integrations.hf.ExpertParallel.sync_grads`) and, in the same
process, the same K steps of the single-process model on the whole batch; per step it compares the
loss (the ranks' mean), this rank's logits (against the reference's rows of its shard) and every
parameter gradient (replicated ones whole, expert weights at this rank's home rows). Errors are
relative to the largest reference magnitude of the compared tensor; the worst over the ranks is
returned on every rank. :func:`check_generate` compares greedy ``generate`` tokens with the ranks
holding different numbers of prompts (so passes carry different token counts per rank).

Tolerances (:data:`TOLERANCE`, relative): in float64 logits and gradients agree to ~1e-15 (only
the order of floating-point sums differs), in float32 to ~1e-6; the loss, which transformers
computes in float32 whatever the model's dtype, to :data:`LOSS_TOLERANCE` (a mean of the ranks'
float32 losses against one float32 mean: ~6e-8 seen); the routers' weight gradients to
:data:`ROUTER_TOLERANCE` (DeepSeek's routers score in float32).
"""

from __future__ import annotations

import copy
from typing import Any, Callable

import torch
import torch.distributed as dist

TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4}
#: transformers computes the causal LM loss in float32 whatever the model's dtype
LOSS_TOLERANCE = 1e-6
#: DeepSeek-V2/V3 routers compute their scores in float32 whatever the model's dtype, so their
#: weights' gradients carry float32 rounding (1.4e-7 seen in float64 runs)
ROUTER_TOLERANCE = 1e-5


def global_batch(vocab: int, n_seq: int, seq: int, seed: int, step: int) -> torch.Tensor:
    """int64 [n_seq, seq] token ids of one step (the same in every process)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    return torch.randint(0, vocab, (n_seq, seq), generator=g)


def even_shard(n: int, R: int, r: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of rank r when n rows are split evenly (the first n % R ranks one more)."""
    base, extra = divmod(n, R)
    lo = r * base + min(r, extra)
    return lo, lo + base + (1 if r < extra else 0)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = float(b.abs().max()) if b.numel() else 0.0
    return float((a - b).abs().max()) / max(scale, 1e-30) if a.numel() else 0.0


def ep_name(name: str) -> str:
    """A parameter name of the expert-parallel model as the single-process model names it."""
    return name.replace(".experts.local.", ".experts.")


def _all_max(vals: list[float], group=None) -> list[float]:
    t = torch.tensor(vals, dtype=torch.float64)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return t.tolist()


def _all_mean(v: float, group=None) -> float:
    t = torch.tensor([v], dtype=torch.float64)
    if dist.get_world_size(group) > 1:
        dist.all_reduce(t, group=group)
    return float(t) / dist.get_world_size(group)


def train_step(model, ids: torch.Tensor, opt, ep=None):
    """One step: forward of ``ids`` (labels = ids), backward, (DDP-style sync), no optimizer step.
    Returns (loss, logits)."""
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    if ep is not None:
        ep.sync_grads()
    return out.loss.detach(), out.logits.detach()


def check_training(build: Callable[[], torch.nn.Module], make_ep: Callable[[torch.nn.Module], Any], *, steps: int,
                   batch: int, seq: int, seed: int, lr: float = 0.05, group=None) -> dict[str, Any]:
    """K steps of the expert-parallel model and of the single-process model (see the module doc).

    build: returns the model (same weights in every process, e.g. seeded).  make_ep: makes it
    expert-parallel (``lambda m: expert_parallel(m, strategy=...)``).
    Returns ``{"loss_err", "logits_err", "grad_err" (all parameters but the routers'),
    "router_grad_err", "worst_grad", "losses", "ref_losses", "copies" (Plan copy slots over the steps and layers), "dtype", "ok", "ep", "model", "ref"}`` (the same on every rank).
    """
    R, r = dist.get_world_size(group), dist.get_rank(group)
    ref = build().train()
    model = copy.deepcopy(ref)
    ep = make_ep(model)
    model.train()
    vocab = int(ref.config.vocab_size)
    o_ref = torch.optim.SGD(ref.parameters(), lr=lr)
    o_ep = torch.optim.SGD(model.parameters(), lr=lr)
    ref_params = dict(ref.named_parameters())
    router_ids = {id(p) for mod in model.modules() if type(mod).__name__.endswith("Router")
                  for p in mod.parameters(recurse=False)}
    router_err = 0.0
    home = ep.home_experts
    loss_err = logits_err = grad_err = 0.0
    worst = ""
    losses, ref_losses = [], []
    copies = 0
    for step in range(steps):
        ids = global_batch(vocab, R * batch, seq, seed, step)
        lo, hi = even_shard(R * batch, R, r)
        l_ref, lg_ref = train_step(ref, ids, o_ref)
        l_ep, lg_ep = train_step(model, ids[lo:hi], o_ep, ep)
        mean_loss = _all_mean(float(l_ep), group)
        losses.append(mean_loss)
        ref_losses.append(float(l_ref))
        loss_err = max(loss_err, abs(mean_loss - float(l_ref)) / max(abs(float(l_ref)), 1e-30))
        logits_err = max(logits_err, _rel(lg_ep, lg_ref[lo:hi]))
        for name, p in model.named_parameters():
            q = ref_params[ep_name(name)]
            want = q.grad if q.grad is not None else torch.zeros_like(q)
            if ep.is_expert_param(p):
                want = want[home]
            got = p.grad if p.grad is not None else torch.zeros_like(p)
            e = _rel(got, want)
            if id(p) in router_ids:
                router_err = max(router_err, e)
            elif e > grad_err:
                grad_err, worst = e, f"{ep_name(name)} (step {step})"
        copies += sum(int(pl.is_copy_S().sum()) for pl in ep.plans().values())
        o_ref.step()
        o_ep.step()
        ep.after_step()
        o_ref.zero_grad(set_to_none=True)
        o_ep.zero_grad(set_to_none=True)
    errs = _all_max([loss_err, logits_err, grad_err, router_err], group)
    # the worst parameter of the rank with the largest gradient error
    mine = torch.tensor([grad_err, float(r)], dtype=torch.float64)
    allm = [torch.empty_like(mine) for _ in range(R)] if R > 1 else [mine]
    if R > 1:
        dist.all_gather(allm, mine, group=group)
    worst_rank = int(max(allm, key=lambda t: float(t[0]))[1])
    dtype = next(ref.parameters()).dtype
    tol = TOLERANCE.get(dtype, 1e-3)
    return {"loss_err": errs[0], "logits_err": errs[1], "grad_err": errs[2], "router_grad_err": errs[3],
            "worst_grad": worst if worst_rank == r else None, "worst_grad_rank": worst_rank,
            "losses": losses, "ref_losses": ref_losses, "copies": copies, "dtype": str(dtype).replace("torch.", ""),
            "tolerance": tol, "loss_tolerance": LOSS_TOLERANCE,
            "router_tolerance": max(ROUTER_TOLERANCE, tol),
            "ok": errs[0] <= LOSS_TOLERANCE and max(errs[1:3]) <= tol and errs[3] <= max(ROUTER_TOLERANCE, tol), "ep": ep, "model": model, "ref": ref}


def prompts_of(R: int, r: int) -> tuple[int, int]:
    """Prompt rows ``[lo, hi)`` of rank r for :func:`check_generate`: rank r holds 1 + (r % 2)
    prompts, so a pass carries different token counts on neighbouring ranks."""
    counts = [1 + (q % 2) for q in range(R)]
    lo = sum(counts[:r])
    return lo, lo + counts[r]


def check_generate(ref, model, *, new_tokens: int, prompt_len: int, seed: int, group=None) -> dict[str, Any]:
    """Greedy ``generate`` of ``new_tokens`` tokens: the expert-parallel ``model`` on this rank's
    prompts (:func:`prompts_of`) against the single-process ``ref`` on all prompts. Every rank runs
    the same number of passes (``min_new_tokens = max_new_tokens``, no EOS). Returns
    ``{"tokens_equal", "passes", "prompts_per_rank"}`` (``tokens_equal``: on every rank)."""
    R, r = dist.get_world_size(group), dist.get_rank(group)
    n = prompts_of(R, R - 1)[1]
    vocab = int(ref.config.vocab_size)
    prompts = torch.randint(0, vocab, (n, prompt_len), generator=torch.Generator().manual_seed(seed + 7))
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0,
              eos_token_id=None)
    ref.eval()
    model.eval()
    with torch.no_grad():
        want = ref.generate(prompts, attention_mask=torch.ones_like(prompts), **kw)
        lo, hi = prompts_of(R, r)
        got = model.generate(prompts[lo:hi], attention_mask=torch.ones_like(prompts[lo:hi]), **kw)
    same = float(got.shape == want[lo:hi].shape and bool(torch.equal(got, want[lo:hi])))
    ok = _all_max([1.0 - same], group)[0] == 0.0
    return {"tokens_equal": ok, "passes": new_tokens, "prompts_per_rank": [prompts_of(R, q)[1] - prompts_of(R, q)[0]
                                                                          for q in range(R)],
            "tokens": got.tolist()}


__all__ = ["TOLERANCE", "check_generate", "check_training", "ep_name", "even_shard", "global_batch", "prompts_of",
           "train_step"]
