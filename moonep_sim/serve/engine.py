"""The serving engine: workers running scheduler iterations over requests, event-driven.

Notation: N requests, R attention ranks of a worker, B KV-cache block (page) tokens. Times in
seconds (step times arrive in microseconds from the step-time model).

**A worker** (:class:`Worker`) is one model replica of ``R`` attention-DP ranks (SGLang's
``--enable-dp-attention``, vLLM's DP attention with EP): every rank runs its own requests, the
experts are EP over all of them, and every iteration waits for the slowest rank. Its role is
``both`` (aggregated), ``prefill`` or ``decode`` (disaggregated pools).

**An iteration** (what vLLM's and SGLang's schedulers do, :meth:`_Engine.start`):

1. every running request whose prompt is computed decodes one token (``1 + mtp_tokens`` with MTP:
   the target model verifies the draft tokens; ``1 + accepted`` are emitted, each draft accepted
   with ``mtp_accept`` while the previous was), and counts against its rank's token budget;
2. the KV cache must hold every running request's tokens after this step (blocks of ``B``); when a
   rank's cache would overflow, the most recently admitted request on it is **preempted**
   (vLLM's recompute preemption: its KV is freed, it goes back to the head of the queue and later
   recomputes its prompt and the tokens it had generated);
3. running prompts continue in chunks (chunked prefill), oldest first, within each rank's budget
   of ``token_budget`` tokens;
4. waiting requests are admitted first come first served (head-of-line: the first that does not
   fit stops admission) to the rank with the fewest running requests that has room under
   ``max_running``, budget left and KV blocks for its first chunk (a prefix-cache hit's tokens
   are in the cache already and are not recomputed);
5. the iteration's shape is the busiest rank's (most tokens): its prefill tokens and decoding
   sequences and their mean contexts; a decode-only iteration is padded up to the next captured
   CUDA-graph batch size (``cuda_graphs``; none above the largest: eager); the step-time model
   prices it for this iteration's routing draw, plus MTP's draft passes
   (``mtp_tokens x mtp_draft_share`` of the step) and, every ``eplb_every`` iterations, EPLB's
   weight copy (``eplb_us``);
6. at its end a prompt whose last chunk ran emits its first token (TTFT); a request that reached
   its output length finishes and frees its KV. In a ``prefill`` worker a finished prompt leaves
   for a decode worker: its KV crosses the link (``kv_transfer_s(tokens)``) and joins the decode
   worker the router picks (fewest outstanding requests).

Arrivals go to the ``both``/``prefill`` worker with the fewest outstanding requests. A closed
loop issues a client's next request when its last finishes. Request state is numpy arrays over N;
each iteration does a handful of numpy operations over its running requests (no per-token loop).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from moonep_sim.errors import require
from moonep_sim.serve.policies import DEFAULT_POLICY, get_policy
from moonep_sim.serve.requests import Requests

ROLES = ("both", "prefill", "decode")
#: the most decode-only iterations run ahead at once (bounds the arrays of one look-ahead)
AHEAD_MAX = 4096


def cuda_graph_sizes(largest: int) -> tuple[int, ...]:
    """Decode batch sizes an engine captures by default: 1, 2, 4, 8, then every 8 up to ``largest``
    (vLLM's and SGLang's default capture lists have this shape)."""
    s = [x for x in (1, 2, 4) if x < largest] + list(range(8, largest + 1, 8))
    return tuple(s) if s and s[-1] == largest else tuple(s + [largest])


@dataclass(frozen=True)
class EngineConfig:
    """One worker's scheduler (per attention rank): ``max_running`` sequences, ``token_budget``
    tokens per iteration (chunked prefill), ``kv_tokens`` KV-cache capacity in tokens,
    ``block`` tokens per KV page, ``cuda_graphs`` decode batch sizes captured (empty: eager),
    ``mtp_tokens`` draft tokens per step with ``mtp_accept`` acceptance and ``mtp_draft_share``
    (one draft pass's share of a step), EPLB every ``eplb_every`` iterations costing ``eplb_us``,
    the scheduler ``policy`` (:mod:`moonep_sim.serve.policies`: ``mixed`` or ``prefill-first``)."""

    max_running: int = 256
    token_budget: int = 8192
    kv_tokens: int = 1 << 20
    block: int = 16
    cuda_graphs: tuple[int, ...] = ()
    mtp_tokens: int = 0
    mtp_accept: float = 0.0
    mtp_draft_share: float = 0.0
    eplb_every: int = 0
    eplb_us: float = 0.0
    policy: str = DEFAULT_POLICY

    def __post_init__(self) -> None:
        get_policy(self.policy)
        require(self.max_running >= 1, f"max running ({self.max_running}) must be >= 1")
        require(self.block >= 1, f"KV block ({self.block}) must be >= 1 token")
        require(self.kv_tokens >= self.block, f"KV capacity ({self.kv_tokens} tokens per rank) must be >= one block "
                                              f"({self.block}): the deployment does not fit in memory")
        require(self.mtp_tokens >= 0 and 0.0 <= self.mtp_accept <= 1.0,
                f"MTP ({self.mtp_tokens} tokens, acceptance {self.mtp_accept}) must have tokens >= 0 and acceptance "
                "in [0, 1]")
        require(self.token_budget >= self.max_running * (1 + self.mtp_tokens),
                f"token budget ({self.token_budget}) must be >= max running x (1 + MTP tokens) "
                f"({self.max_running} x {1 + self.mtp_tokens}): every running sequence decodes each iteration")
        require(self.eplb_every >= 0 and self.eplb_us >= 0, f"EPLB ({self.eplb_every}, {self.eplb_us} us) must be >= 0")


@dataclass
class Worker:
    """A replica: ``role``, ``ranks`` attention-DP ranks, ``gpus``, its scheduler ``cfg`` and its
    step-time model (``time_us(n_pre, c_pre, n_dec, c_dec, draw)``)."""

    role: str
    ranks: int
    gpus: int
    cfg: EngineConfig
    steptime: Any
    name: str = ""

    def __post_init__(self) -> None:
        require(self.role in ROLES, f"worker role ({self.role!r}) must be one of {', '.join(ROLES)}")
        require(self.ranks >= 1 and self.gpus >= self.ranks, f"worker ranks ({self.ranks}) must be in [1, gpus "
                                                             f"{self.gpus}]")


@dataclass
class _W:
    """A worker's run state."""

    w: Worker
    running: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    waiting: list = field(default_factory=list)        # FCFS; index 0 is the head
    busy: bool = False
    iters: int = 0
    # the iteration in flight: (prefill ids, their chunk tokens, decode ids, draft tokens each)
    inflight: tuple | None = None
    mixes: bool = True                                  # its scheduler policy mixes prompts and decodes


@dataclass(frozen=True)
class ServeRun:
    """What a run produced. Per request (N): ``arrival_s``, ``first_s`` (first token), ``finish_s``,
    ``preempted`` (times), ``worker`` (the decode-side worker). Per iteration (I, by start time): ``it_worker``,
    ``it_start_s``, ``it_dur_s``, ``it_decode_seqs`` (sequences that emitted a decode token),
    ``it_tokens`` (tokens emitted), ``it_prefill_tokens``, ``it_kv_use`` (the busiest rank's KV use,
    0..1), ``it_shape`` ([I, 4]: n_pre, c_pre, n_dec, c_dec of the busiest rank as priced)."""

    arrival_s: np.ndarray
    first_s: np.ndarray
    finish_s: np.ndarray
    preempted: np.ndarray
    worker: np.ndarray
    it_worker: np.ndarray
    it_start_s: np.ndarray
    it_dur_s: np.ndarray
    it_decode_seqs: np.ndarray
    it_tokens: np.ndarray
    it_prefill_tokens: np.ndarray
    it_kv_use: np.ndarray
    it_shape: np.ndarray
    emitted: np.ndarray


class _Engine:
    def __init__(self, req: Requests, workers: Sequence[Worker], kv_transfer_s: Callable[[int], float],
                 seed: int, draw_order: str, ahead: bool = True) -> None:
        require(len(workers) >= 1, "a deployment needs at least one worker")
        roles = {w.role for w in workers}
        require(roles == {"both"} or roles == {"prefill", "decode"},
                f"workers ({', '.join(sorted(roles))}) must be all aggregated (both) or prefill and decode pools")
        require(draw_order in ("in-order", "resample"), f"draw order ({draw_order!r}) must be in-order or resample")
        self.req, self.kv_transfer_s, self.order, self.ahead = req, kv_transfer_s, draw_order, ahead
        self.rng = np.random.default_rng(np.random.SeedSequence([int(seed), 331]))
        self.W = [_W(w, mixes=get_policy(w.cfg.policy).mixes) for w in workers]
        self.front = [i for i, w in enumerate(workers) if w.role in ("both", "prefill")]
        self.back = [i for i, w in enumerate(workers) if w.role == "decode"]
        N = req.n
        self.arr = req.arrival_s_N.astype(float).copy()
        self.isl, self.osl, self.hit = req.input_N, req.output_N, req.hit_N
        self.need = self.isl.copy()                  # tokens to compute before decoding (grows on preemption)
        self.comp = np.zeros(N, np.int64)            # tokens in this request's KV
        self.gen = np.zeros(N, np.int64)             # output tokens emitted
        self.rank = np.full(N, -1, np.int64)
        self.first = np.full(N, np.nan)
        self.finish = np.full(N, np.nan)
        self.pre = np.zeros(N, np.int64)
        self.where = np.full(N, -1, np.int64)
        self.kv_R = [np.zeros(w.ranks, np.int64) for w in workers]          # KV blocks in use per rank
        self.cap_blocks = [w.cfg.kv_tokens // w.cfg.block for w in workers]
        for w in workers:    # every request must fit one rank's cache alone, or the engine could not run it
            if w.role in ("both", "decode"):
                need = int((self.isl + self.osl).max())
                require(need <= w.cfg.kv_tokens, f"KV capacity ({w.cfg.kv_tokens} tokens per rank of worker "
                                                 f"{w.name or w.role}) must hold the longest request ({need} tokens): "
                                                 "the deployment does not fit")
            else:
                require(int(self.isl.max()) <= w.cfg.kv_tokens,
                        f"KV capacity ({w.cfg.kv_tokens} tokens per rank of prefill worker {w.name}) must hold the "
                        f"longest prompt ({int(self.isl.max())} tokens): the deployment does not fit")
        self.events: list = []
        self.seq = 0
        self.preempted_now = False
        self.its: list[tuple] = []
        self.next_issue = 0

    # -- events ------------------------------------------------------------------------------------
    def push(self, t: float, kind: int, a: int) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, a))

    def outstanding(self, i: int) -> int:
        return len(self.W[i].running) + len(self.W[i].waiting)

    def route(self, pool: list[int]) -> int:
        return min(pool, key=self.outstanding)

    def enqueue(self, t: float, i: int, r: int, head: bool = False) -> None:
        s = self.W[i]
        self.where[r] = i
        if head:
            s.waiting.insert(0, r)
        else:
            s.waiting.append(r)
        if not s.busy:     # woken after every other event at this time (all arrivals at t join the batch)
            s.busy = True
            self.push(t, 3, i)

    # -- one iteration -----------------------------------------------------------------------------
    def _blocks(self, i: int, tokens: np.ndarray) -> np.ndarray:
        B = self.W[i].w.cfg.block
        return -(-tokens // B)

    def _preempt(self, i: int, run: np.ndarray, decode: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Steps 1-2 of :meth:`start` on worker ``i``: the running requests' decodes and KV growth
        (none when ``decode`` is False: a prefill-only iteration), preempting (newest first on an
        overflowing rank, back to the head of the queue) until every rank's KV blocks fit. Returns
        the running and decoding requests and the blocks per rank [R]."""
        s, w = self.W[i], self.W[i].w
        k, R = w.cfg.mtp_tokens, w.ranks
        while True:
            comp = self.comp[run]
            decoding = comp >= self.need[run] if w.role != "prefill" and decode else np.zeros(len(run), bool)
            dec = run[decoding]
            blocks_R = np.bincount(self.rank[run], weights=self._blocks(i, comp + decoding * (1 + k)),
                                   minlength=R).astype(np.int64) if len(run) else np.zeros(R, np.int64)
            over = np.flatnonzero(blocks_R > self.cap_blocks[i])
            if not len(over):
                return run, dec, blocks_R
            self.preempted_now = True
            victim_pos = np.flatnonzero(self.rank[run] == over[0])[-1]
            v = int(run[victim_pos])
            run = np.delete(run, victim_pos)
            self.pre[v] += 1
            self.need[v] = self.isl[v] + self.gen[v]
            self.comp[v] = self.hit[v]
            self.rank[v] = -1
            s.waiting.insert(0, v)

    def start(self, t: float, i: int) -> None:
        s, w = self.W[i], self.W[i].w
        self.preempted_now = False    # a request preempted here may be admitted next: no iterations run ahead
        if not s.mixes and w.role == "both":
            # prefill-first: a prompt chunk that can run makes this iteration prefill-only
            if len(s.waiting) or bool(np.any(self.comp[s.running] < self.need[s.running])):
                run, dec, blocks_R = self._preempt(i, s.running, decode=False)
                if self._iterate(t, i, run, dec, blocks_R, decodes=False):
                    return
        run, dec, blocks_R = self._preempt(i, s.running)
        self._iterate(t, i, run, dec, blocks_R, decodes=True, prompts=s.mixes or w.role != "both")

    def _iterate(self, t: float, i: int, run: np.ndarray, dec: np.ndarray, blocks_R: np.ndarray, decodes: bool,
                 prompts: bool = True) -> bool:
        """Steps 3-5 of an iteration on worker ``i`` (see :meth:`start`): prompt chunks (none when
        ``prompts`` is False) beside the decodes (none when ``decodes`` is False), priced and put in
        flight. A prefill-only iteration with no chunk to run returns False and changes nothing."""
        s, w = self.W[i], self.W[i].w
        cfg, R = w.cfg, w.ranks
        k = cfg.mtp_tokens
        budget_R = np.full(R, cfg.token_budget, np.int64)
        run_R = np.bincount(self.rank[run], minlength=R) if len(run) else np.zeros(R, np.int64)
        if len(dec):
            budget_R -= np.bincount(self.rank[dec], minlength=R) * (1 + k)
        # 3: running prompts continue, oldest first (under prefill-first, within the free KV pages as
        # SGLang's prefill adder keeps them: a chunk never overflows the cache)
        pf_ids, pf_tok = [], []
        free_R = self.cap_blocks[i] - blocks_R
        capped = not s.mixes
        B = cfg.block
        pr = run[self.comp[run] < self.need[run]] if prompts else run[:0]
        if len(pr) and not capped:
            # each takes min(its rest, the budget its rank's older prompts left): one pass per rank
            rem, q = self.need[pr] - self.comp[pr], self.rank[pr]
            o = np.argsort(q, kind="stable")
            qs, rs = q[o], rem[o]
            cs = np.cumsum(rs)
            first = np.searchsorted(qs, qs, side="left")
            before = cs - rs - (cs[first] - rs[first])
            c = np.minimum(np.maximum(budget_R[qs] - before, 0), rs)
            budget_R -= np.bincount(qs, weights=c, minlength=R).astype(np.int64)
            live = c > 0
            pf_ids, pf_tok = pr[o][live].tolist(), c[live].tolist()
            pr = pr[:0]
        for r in pr.tolist():
            q = self.rank[r]
            c = int(min(self.need[r] - self.comp[r], budget_R[q]))
            if capped:
                have = -(-int(self.comp[r]) // B)
                c = max(min(c, (have + int(free_R[q])) * B - int(self.comp[r])), 0)
                free_R[q] -= -(-(int(self.comp[r]) + c) // B) - have
            if c > 0:
                budget_R[q] -= c
                pf_ids.append(r)
                pf_tok.append(c)
        # 4: admission, FCFS, head-of-line
        admitted, dec_new = [], []
        while s.waiting and prompts:
            r = s.waiting[0]
            ok = (run_R < cfg.max_running) & (budget_R > 0)
            with_kv = bool(self.comp[r] >= self.need[r])     # a decode worker's arrival: its prompt's KV came along
            if with_kv:
                # arrives with its prompt's KV: decodes at once, needs room for it and the next tokens
                need_b = self._blocks(i, np.int64(self.comp[r] + 1 + k))
                ok &= free_R >= need_b
            else:
                chunk_R = np.minimum(self.need[r] - self.hit[r], budget_R)
                ok &= free_R >= self._blocks(i, self.hit[r] + chunk_R)
            if not ok.any():
                break
            cand = np.flatnonzero(ok)
            q = int(cand[np.argmin(run_R[cand])])
            s.waiting.pop(0)
            self.rank[r] = q
            run_R[q] += 1
            admitted.append(r)
            if with_kv:
                dec_new.append(r)
                free_R[q] -= need_b
                budget_R[q] -= 1 + k
            else:
                self.comp[r] = self.hit[r]
                c = int(min(self.need[r] - self.comp[r], budget_R[q]))
                budget_R[q] -= c
                free_R[q] -= self._blocks(i, np.int64(self.comp[r] + c))
                pf_ids.append(r)
                pf_tok.append(c)
        if admitted:
            run = np.concatenate([run, np.asarray(admitted, np.int64)])
            if dec_new:
                dec = np.concatenate([dec, np.asarray(dec_new, np.int64)])
        if not decodes and not pf_ids:
            return False
        s.running = run
        if not len(pf_ids) and not len(dec):
            s.busy = False
            return True
        # 5: the busiest rank's shape, priced
        pf = np.asarray(pf_ids, np.int64)
        pt = np.asarray(pf_tok, np.int64)
        dt, shape = self._price(i, pf, pt, dec, blocks_R)
        more = self._ahead(t + dt, i, run, dec, shape[2], shape[3]) if self.ahead and not len(pf) and len(dec) \
            and not cfg.mtp_tokens and not cfg.eplb_every and not self.preempted_now else []
        s.inflight = (pf, pt, dec, (t, dt) + shape, more)
        s.busy = True
        self.push(more[-1][0] + more[-1][1] if more else t + dt, 1, i)   # the sums one at a time gives
        return True

    def _price(self, i: int, pf: np.ndarray, pt: np.ndarray, dec: np.ndarray, blocks_R: np.ndarray):
        """Step 5 of an iteration on worker ``i``: the busiest rank's shape (prompt chunks ``pf`` of
        ``pt`` tokens, decodes ``dec``) priced by the worker's step-time model. Returns the
        iteration's seconds and its record ``(n_pre, c_pre, n_dec, c_dec, kv_use)``."""
        s, w = self.W[i], self.W[i].w
        cfg, R = w.cfg, w.ranks
        k = cfg.mtp_tokens
        pre_R = np.bincount(self.rank[pf], weights=pt, minlength=R) if len(pf) else np.zeros(R)
        dec_R = np.bincount(self.rank[dec], minlength=R) if len(dec) else np.zeros(R)
        b = int(np.argmax(pre_R + dec_R * (1 + k)))
        n_pre, n_dec = int(pre_R[b]), int(dec_R[b])
        c_pre = float((self.comp[pf] + pt).sum()) / len(pf) if len(pf) else 0.0
        c_dec = float(self.comp[dec].sum()) / len(dec) + 1.0 if len(dec) else 0.0
        if n_pre == 0 and cfg.cuda_graphs and n_dec <= cfg.cuda_graphs[-1]:
            n_dec = int(cfg.cuda_graphs[int(np.searchsorted(cfg.cuda_graphs, n_dec))])
        d = s.iters if self.order == "in-order" else int(self.rng.integers(1 << 30))
        d %= max(int(getattr(w.steptime, "draws", 1)), 1)
        us = w.steptime.time_us(n_pre, c_pre, n_dec * (1 + k), c_dec, d)
        if k and n_dec:
            us += k * cfg.mtp_draft_share * w.steptime.time_us(0, 0.0, n_dec, c_dec, d)
        s.iters += 1
        if cfg.eplb_every and s.iters % cfg.eplb_every == 0:
            us += cfg.eplb_us
        dt = us * 1e-6
        kv_use = float((blocks_R[b] + 0.0) / self.cap_blocks[i])
        return dt, (n_pre, c_pre, n_dec, c_dec, kv_use)

    def _ahead(self, t1: float, i: int, run: np.ndarray, dec: np.ndarray, n_dec: int, c_dec: float) -> list[tuple]:
        """The decode-only iterations that follow this one unchanged, run at once: until the first
        running request finishes, a rank's KV would overflow, or the next event (an arrival, a KV
        transfer, another worker's iteration) is due -- nothing can be admitted in between (the
        limits only tighten while the batch grows). Each is priced as its own iteration (its
        context one token longer, its own routing draw, drawn in the same order), so the run is the
        one iteration at a time gives; returns their (start, duration, context, KV use)."""
        s, w = self.W[i], self.W[i].w
        nxt = self.events[0][0] if self.events else np.inf
        m = int((self.osl[dec] - self.gen[dec]).min())   # iterations until the first finish, this one included
        if m <= 1 or t1 >= nxt:
            return []
        m = min(m, AHEAD_MAX)
        b = int(np.argmax(np.bincount(self.rank[dec], minlength=w.ranks)))   # the busiest rank, as priced
        g = np.arange(2, m + 1)                          # KV growth of iteration j = g - 1 (1, 2, ...)
        blocks = self._blocks_grown(i, run, g)
        over = (blocks > self.cap_blocks[i]).any(axis=1)
        if over.any():
            m = int(g[int(np.argmax(over))]) - 1
        kv = blocks[:m - 1, b] / self.cap_blocks[i]
        D = max(int(getattr(w.steptime, "draws", 1)), 1)
        out, t0 = [], t1
        tot, nd = int(self.comp[dec].sum()), len(dec)
        for j in range(1, m):
            if t0 >= nxt:
                break
            d = (s.iters if self.order == "in-order" else int(self.rng.integers(1 << 30))) % D
            c = float(tot + j * nd) / nd + 1.0                  # the mean context as the iteration computes it
            dt = w.steptime.time_us(0, 0.0, n_dec, c, d) * 1e-6
            s.iters += 1
            out.append((t0, dt, c, float(kv[j - 1])))
            t0 += dt
        return out

    def _blocks_grown(self, i: int, run: np.ndarray, g: np.ndarray) -> np.ndarray:
        """[len(g), R] KV blocks per rank with every decoding request ``g`` tokens longer (the
        others as they are): per rank, sum of ceil((c + g) / B) by the residues of c mod B."""
        cfg, R = self.W[i].w.cfg, self.W[i].w.ranks
        B = cfg.block
        c, q = self.comp[run], self.rank[run]
        d = c >= self.need[run]
        static = np.bincount(q[~d], weights=-(-c[~d] // B), minlength=R)
        base = c[d] + B - 1
        n = np.bincount(q[d], minlength=R)
        full = np.bincount(q[d], weights=base // B, minlength=R)
        hist = np.bincount(q[d] * B + base % B, minlength=R * B).reshape(R, B)
        ge = np.cumsum(hist[:, ::-1], axis=1)[:, ::-1]     # ge[r, x]: requests on rank r with residue >= x
        thr = B - g % B                                      # ceil grows by one more where residue >= thr
        cnt = np.where((thr < B)[:, None], ge[:, np.minimum(thr, B - 1)].T, 0.0)
        return static[None, :] + full[None, :] + n[None, :] * (g // B)[:, None] + cnt

    def end(self, t: float, i: int) -> None:
        s, w = self.W[i], self.W[i].w
        k = w.cfg.mtp_tokens
        pf, pt, dec, info, more = s.inflight
        s.inflight = None
        emitted = 0
        # decodes: 1 + accepted draft tokens each (and one per iteration run ahead)
        if len(dec):
            if k:
                acc = np.cumprod(self.rng.random((len(dec), k)) < w.cfg.mtp_accept, axis=1).sum(axis=1)
                m = 1 + acc
            else:
                m = np.full(len(dec), 1 + len(more), np.int64)
            m = np.minimum(m, self.osl[dec] - self.gen[dec])
            self.gen[dec] += m
            self.comp[dec] += m
            emitted += int(m.sum())
        # prompts: the chunk's tokens; a completed prompt emits a token
        done_pf = pf[:0]
        if len(pf):
            self.comp[pf] += pt
            done_pf = pf[self.comp[pf] >= self.need[pf]]
            if len(done_pf):
                self.first[done_pf] = np.where(np.isnan(self.first[done_pf]), t, self.first[done_pf])
                self.gen[done_pf] += 1
                emitted += len(done_pf)
        t0, dt, n_pre, c_pre, n_dec, c_dec, kv_use = info
        first = emitted - len(dec) * len(more)
        self.its.append((i, t0, dt, len(dec), first, int(pt.sum()) if len(pt) else 0, kv_use, n_pre, c_pre,
                         n_dec, c_dec))
        self.its += [(i, a, b_, len(dec), len(dec), 0, u, 0, 0.0, n_dec, c) for a, b_, c, u in more]
        run = s.running
        fin = run[self.gen[run] >= self.osl[run]]
        if len(fin):
            self.finish[fin] = t
            run = run[self.gen[run] < self.osl[run]]
        if w.role == "prefill" and len(done_pf):
            leave = done_pf[self.gen[done_pf] < self.osl[done_pf]]
            run = run[~np.isin(run, leave)]
            for r in leave.tolist():
                j = self.route(self.back)
                self.rank[r] = -1
                self.push(t + self.kv_transfer_s(int(self.comp[r])), 2, r * len(self.W) + j)
        s.running = run
        for r in fin.tolist():
            self.rank[r] = -1
            if self.req.closed and self.next_issue < self.req.n:
                self.issue(t)
        self.start(t, i)

    def issue(self, t: float) -> None:
        r = self.next_issue
        self.next_issue += 1
        self.arr[r] = t
        self.push(t, 0, r)

    def run(self, progress: Callable[[int, int], None] | None = None) -> ServeRun:
        N = self.req.n
        if self.req.closed:
            for _ in range(min(self.req.closed, N)):
                self.issue(0.0)
        else:
            for r in range(N):
                self.push(float(self.arr[r]), 0, r)
        done = 0
        while self.events:
            t, _, kind, a = heapq.heappop(self.events)
            if kind == 0:
                self.enqueue(t, self.route(self.front), a)
            elif kind == 1:
                self.end(t, a)
                if progress is not None:
                    n = int(np.count_nonzero(~np.isnan(self.finish)))
                    if n != done:
                        done = n
                        progress(n, N)
            elif kind == 2:
                r, j = divmod(a, len(self.W))
                self.enqueue(t, j, r)
            else:
                self.start(t, a)
        its = np.asarray(self.its, float).reshape(-1, 11)
        its = its[np.lexsort((its[:, 0], its[:, 1]))]     # iterations by start time, then worker
        return ServeRun(self.arr, self.first, self.finish, self.pre, self.where, its[:, 0].astype(np.int64),
                        its[:, 1], its[:, 2], its[:, 3].astype(np.int64), its[:, 4].astype(np.int64),
                        its[:, 5].astype(np.int64), its[:, 6], its[:, 7:11], self.gen.copy())


def simulate(req: Requests, workers: Sequence[Worker], *, kv_transfer_s: Callable[[int], float] = lambda n: 0.0,
             seed: int = 0, draw_order: str = "resample",
             progress: Callable[[int, int], None] | None = None, ahead: bool = True) -> ServeRun:
    """Run ``req`` through ``workers`` (see the module docstring). ``kv_transfer_s(tokens)``: the
    seconds a prompt's KV takes from a prefill to a decode worker. ``draw_order``: each iteration's
    routing draw of the step-time model, ``in-order`` (iteration j of a worker takes draw j mod D:
    a recorded trace's steps in order) or ``resample`` (uniform, seeded). ``ahead``: run the
    decode-only iterations in which nothing can change at once (:meth:`_Engine._ahead`; the same
    run, faster); False steps every iteration through the event queue (for checking)."""
    return _Engine(req, workers, kv_transfer_s, seed, draw_order, ahead).run(progress)


__all__ = ["EngineConfig", "ROLES", "ServeRun", "Worker", "cuda_graph_sizes", "simulate"]
