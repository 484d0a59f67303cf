"""Sort-free exact sampling: temperature, min_p, top_k and top_p in one kernel, one program a row.

Work. Row r of logits [rows, vocab] (fp32) samples one token from the distribution that
`flashlet.runner.sampler.sampling_probs` (the torch reference, vLLM's order) describes: l = logits / T;
min_p drops tokens with exp(l - max) < min_p; top_k keeps l >= the k-th largest (ties with the
k-th kept); top_p then keeps token t when the renormalised mass of the tokens strictly above it is
below top_p; the most likely token always stays; a -inf logit is never picked.

Design (rejection with pivots, the idea behind FlashInfer's sorting-free samplers). Every filter
keeps a top set {l >= threshold}, so the kept set A is one too. Pass 1 finds max(l), and the
mass sum(exp(l - max)) of every block of 4 * SUB elements; a candidate s is then drawn from
softmax(l) over the whole row by inverse CDF: a block with one uniform over the block masses,
and a token in it with another over its elements (one block re-read). Each further pass
computes, for the candidate, count(l > l_s), mass(l > l_s) and the mass of the min_p/top_k-
filtered set, which decide whether s is in A, and the block masses of {l > l_s}. If s is in A it
is the token; otherwise every token of A lies above l_s, so the next candidate is drawn, with
fresh uniforms, from {l > l_s} by those block masses. A draw from softmax restricted to a
superset R of A, kept when it falls in A and otherwise redrawn from a smaller superset, is
distributed exactly as softmax restricted to A. On flat rows (top_p 0.9 keeps ~90% of the
vocabulary) the first candidate is accepted ~90% of the time; on peaked rows the second one
nearly always is: about two passes over the row either way. Per element a pass costs a
division, an exp and a few compares and adds, accumulated per lane and reduced once a block
or once a pass. (The first form drew candidates by an exponential race, a Philox number and
two logs per element a pass: compute-bound, over ten times one read of the rows at the copy
bandwidth.)
top_k together with top_p needs the mass of the top-k set, so such rows first find the k-th
largest value tau exactly, by counting against 15 pivots per pass over the values' ordered bits
(~8 passes), and draw only from {l >= tau} from then on. top_k alone on a flat row takes about
ln(vocab / top_k) rounds (each rejected candidate cuts what is left by a random fraction).

Noise: two Philox uniforms a round (`tl.rand`) keyed by a per-row 64-bit seed, counter = the
round: a row's tokens depend only on its seed (and the block size), never on the batch around it.
The sampler passes (seed, position) per row and the kernel mixes them (splitmix64, as
`flashlet.core.sampling.noise_seed` on the host) and advances the position itself, so a steady batch
needs no per-row host work: a seeded row's seed is its request's seed and output position, an
unseeded row's the step's random seed and its row.

Penalties (`penalise_rows`, `record_rows`): one program a penalised row, over its seen ids (the
sparse form of `flashlet.runner.sampler.apply_penalties`), and after sampling one that adds the row's
token to its counts and seen ids: two launches where torch takes about twenty.

Ties at the top_p boundary: the reference sorts and keeps a prefix, so of several tokens tied
with the last kept one it keeps some (in sort order); here the condition is on the value, so all
of them stay (as top_k's ties do). Masses are fp32 sums in another order than the reference's
cumsum, so a token whose cumulative mass is within rounding of top_p may fall on either side.

Bytes per row: about 2-3 reads of the row (one more per rejected candidate; ~8 more with
top_k and top_p together), fp32, plus one block per drawn candidate."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# A row's program: 32 warps, blocks of 4096: the best of lab/bench_sampler.py --sweep over block
# sizes and warps on flat, peaked and top-k rows (figures in BENCHMARKS.md's history).
SUB = 1024  # a block is 4 * SUB elements (the k-th largest search counts SUB at a time)
NUM_WARPS = 32
NUM_PIVOTS = 15  # the k-th largest search cuts the interval of candidate values in 16 a pass
NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _ordered_bits(l):
    """fp32 -> int32 that compares as the floats do (negative floats have their order flipped)."""
    bits = l.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _scaled(row_ptr, offs, V, T):
    x = tl.load(row_ptr + offs, mask=offs < V, other=NEG_INF).to(tl.float32)
    return tl.math.div_rn(x, T)  # correctly rounded, as torch's logits / temperature


@triton.jit
def _block_l(row_ptr, b, V, T, BLOCK: tl.constexpr):
    """Block b of the row: its element indices and l = logits / T (-inf past the vocabulary)."""
    offs = b * BLOCK + tl.arange(0, BLOCK)
    return offs, _scaled(row_ptr, offs, V, T)


@triton.jit
def _load_block(row_ptr, b, V, BLOCK: tl.constexpr):
    """Block b's logits as loaded (-inf past the vocabulary). The passes load block b + 1
    before they work on block b: one program a row has only its own loads to hide the
    memory's latency with, and a block's reductions would otherwise wait for each load."""
    offs = b * BLOCK + tl.arange(0, BLOCK)
    return tl.load(row_ptr + offs, mask=offs < V, other=NEG_INF).to(tl.float32)


@triton.jit
def _first_pass(row_ptr, V, T, BLOCK: tl.constexpr, NB: tl.constexpr):
    """-> max(l), the count of finite l, and every block's mass sum(exp(l - max)) [NB] (0 past
    the last block): each block's mass is taken against its own maximum and rescaled once the
    row's is known, so one pass over the row gives all three."""
    ids = tl.arange(0, NB)
    masses = tl.zeros((NB,), tl.float32)
    maxes = tl.full((NB,), NEG_INF, tl.float32)
    n_finite = tl.zeros((BLOCK,), tl.int32)
    x = _load_block(row_ptr, 0, V, BLOCK)
    for b in range(0, tl.cdiv(V, BLOCK)):
        x_next = _load_block(row_ptr, b + 1, V, BLOCK)
        l = tl.math.div_rn(x, T)
        x = x_next
        finite = l > NEG_INF
        mb = tl.max(l)
        mass = tl.sum(tl.where(finite, tl.exp(l - mb), 0.0))
        masses = tl.where(ids == b, mass, masses)
        maxes = tl.where(ids == b, mb, maxes)
        n_finite += finite.to(tl.int32)
    m = tl.max(maxes)
    masses = tl.where(maxes > NEG_INF, masses * tl.exp(maxes - m), 0.0)
    return m, tl.sum(n_finite), masses


@triton.jit
def _draw(row_ptr, V, T, seed, rnd, masses, m, lo, tau, BLOCK: tl.constexpr, NB: tl.constexpr):
    """A token drawn from softmax(l) restricted to R = {l > lo, l >= tau}, given R's mass per
    block (`masses`, relative to exp(m)): a block by inverse CDF over the block masses, then a
    token of that block by inverse CDF over its elements, each with a fresh uniform of round
    `rnd` -> (token, whether R was empty). Rounding between a block's stored mass and its
    recomputed cumulative sum only moves a draw to a neighbour with positive mass."""
    ids = tl.arange(0, NB)
    u = tl.rand(seed, 2 * rnd + tl.arange(0, 2))
    u_block = tl.sum(tl.where(tl.arange(0, 2) == 0, u, 0.0))
    u_elem = tl.sum(tl.where(tl.arange(0, 2) == 1, u, 0.0))
    total = tl.sum(masses)
    cum = tl.cumsum(masses, 0)
    live = masses > 0
    b = tl.min(tl.where(live & (cum > u_block * total), ids, NB))
    b = tl.where(b == NB, tl.max(tl.where(live, ids, -1)), b)  # u * total rounded past the end
    offs, l = _block_l(row_ptr, b, V, T, BLOCK)
    w = tl.where((l > lo) & (l >= tau), tl.exp(l - m), 0.0)
    c = tl.cumsum(w, 0)
    pick = tl.min(tl.where((w > 0) & (c > u_elem * tl.sum(w)), offs, 2147483647))
    last = tl.max(tl.where(w > 0, offs, -1))
    token = tl.where(pick == 2147483647, last, pick)
    empty = (total <= 0) | (token < 0)
    return tl.where(empty, 0, token), empty


@triton.jit
def _round_pass(row_ptr, V, T, l_s, m, tau, min_p, BLOCK: tl.constexpr, NB: tl.constexpr):
    """For candidate value l_s: count(l > l_s), mass(l > l_s), the mass of the min_p/top_k-kept
    set {l >= tau, exp(l - m) >= min_p} (masses relative to exp(m)), and the per-block masses of
    {l > l_s, l >= tau}, which hold the next candidate if this one is rejected. Per-lane
    accumulators, reduced once at the end (a block reduction only for the block masses)."""
    ids = tl.arange(0, NB)
    count_above = tl.zeros((BLOCK,), tl.int32)
    mass_above = tl.zeros((BLOCK,), tl.float32)
    mass_kept = tl.zeros((BLOCK,), tl.float32)
    masses = tl.zeros((NB,), tl.float32)
    x = _load_block(row_ptr, 0, V, BLOCK)
    for b in range(0, tl.cdiv(V, BLOCK)):
        x_next = _load_block(row_ptr, b + 1, V, BLOCK)
        l = tl.math.div_rn(x, T)
        x = x_next
        w = tl.exp(l - m)
        above = l > l_s
        count_above += above.to(tl.int32)
        mass_above += tl.where(above, w, 0.0)
        mass_kept += tl.where((l >= tau) & (w >= min_p), w, 0.0)
        masses = tl.where(ids == b, tl.sum(tl.where(above & (l >= tau), w, 0.0)), masses)
    return tl.sum(count_above), tl.sum(mass_above), tl.sum(mass_kept), masses


@triton.jit
def _kth_largest(row_ptr, V, T, k, m, SUB: tl.constexpr, NUM_PIVOTS: tl.constexpr):
    """The k-th largest l of the row (needs k <= its count of finite l), exactly: bisection over
    the ordered bits with NUM_PIVOTS pivots a pass, keeping count(l >= lo) >= k > count(l >= hi)."""
    lanes = tl.arange(0, SUB)  # [pivots, SUB] comparisons a step: registers, not 4 * SUB
    js = tl.arange(0, NUM_PIVOTS + 1)  # one spare column, unused (pivot lists must be a power of 2)
    lo = (_ordered_bits(tl.full((), NEG_INF, tl.float32)) + 1).to(tl.int64)  # least finite
    hi = _ordered_bits(m).to(tl.int64) + 1
    while hi - lo > 1:
        pivots = lo + (hi - lo) * (js + 1) // (NUM_PIVOTS + 1)  # [NUM_PIVOTS + 1], last = hi
        narrow = pivots.to(tl.int32)  # the interval lies in int32 (hi - lo does not, always)
        lane_counts = tl.zeros([NUM_PIVOTS + 1, SUB], tl.int32)  # reduced once a pass
        for start in range(0, V, SUB):
            bits = _ordered_bits(_scaled(row_ptr, start + lanes, V, T))
            lane_counts += (bits[None, :] >= narrow[:, None]).to(tl.int32)
        counts = tl.sum(lane_counts, 1)
        enough = (counts >= k) & (js < NUM_PIVOTS)
        lo = tl.maximum(lo, tl.max(tl.where(enough, pivots, lo), 0))
        hi = tl.minimum(hi, tl.min(tl.where(enough, hi, pivots), 0))
    bits = lo.to(tl.int32)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.float32, bitcast=True)


@triton.jit
def _accepts(l_s, m, count_above, mass_above, mass_kept, top_k, top_p, min_p):
    """Is the candidate (value l_s) in the kept set? The most likely token always is."""
    keep_min_p = tl.exp(l_s - m) >= min_p
    keep_k = (top_k == 0) | (count_above < top_k)
    keep_p = (top_p >= 1.0) | (count_above == 0) | (mass_above < top_p * mass_kept)
    return keep_min_p & keep_k & keep_p


@triton.jit
def _threshold(row_ptr, V, T, top_k, top_p, m, n_finite, SUB: tl.constexpr,
               NUM_PIVOTS: tl.constexpr):
    """The top-k value bound for the kept mass: only top_p needs it (-inf when it keeps all)."""
    tau = tl.full((), NEG_INF, tl.float32)
    if (top_k > 0) & (top_p < 1.0) & (top_k < n_finite):
        tau = _kth_largest(row_ptr, V, T, top_k, m, SUB, NUM_PIVOTS)
    return tau


@triton.jit
def _splitmix64(a, b):
    """flashlet.core.sampling._splitmix64 of two int64s (63 bits out), in wrapping uint64 arithmetic."""
    z = a.to(tl.uint64, bitcast=True) * tl.full((), 0x9E3779B97F4A7C15, tl.uint64)
    z = z + b.to(tl.uint64, bitcast=True) + tl.full((), 0x632BE59BD9B4E5B, tl.uint64)
    z = (z ^ (z >> 30)) * tl.full((), 0xBF58476D1CE4E5B9, tl.uint64)
    z = (z ^ (z >> 27)) * tl.full((), 0x94D049BB133111EB, tl.uint64)
    return ((z ^ (z >> 31)) >> 1).to(tl.int64, bitcast=True)


@triton.jit
def _row_seed(ids_ptr, pid, step_seed, MIXED: tl.constexpr):
    """-> (row of logits, Philox seed). ids [n, 2]: (row, seed); MIXED, ids [n, 3]: (row, seed,
    position), the seed splitmix64(seed, position) and the position advanced in place, or, for a
    position < 0 (an unseeded row), splitmix64(step_seed, row)."""
    if MIXED:
        row = tl.load(ids_ptr + 3 * pid)
        base = tl.load(ids_ptr + 3 * pid + 1)
        position = tl.load(ids_ptr + 3 * pid + 2)
        seeded = position >= 0
        seed = _splitmix64(tl.where(seeded, base, step_seed), tl.where(seeded, position, row))
        if seeded:
            tl.store(ids_ptr + 3 * pid + 2, position + 1)
    else:
        row = tl.load(ids_ptr + 2 * pid)
        seed = tl.load(ids_ptr + 2 * pid + 1)
    return row, seed


@triton.jit(do_not_specialize=["step_seed"])
def _sample_kernel(logits_ptr, stride, params_ptr, ids_ptr, out_ptr, V, step_seed,
                   BLOCK: tl.constexpr, NB: tl.constexpr, SUB: tl.constexpr,
                   NUM_PIVOTS: tl.constexpr, MIXED: tl.constexpr):
    pid = tl.program_id(0)
    row, seed = _row_seed(ids_ptr, pid, step_seed, MIXED)
    T = tl.load(params_ptr + 4 * pid)  # params [n, 4] fp32: temperature, top_k, top_p, min_p
    top_k = tl.load(params_ptr + 4 * pid + 1).to(tl.int32)
    top_p = tl.load(params_ptr + 4 * pid + 2)
    min_p = tl.load(params_ptr + 4 * pid + 3)
    row_ptr = logits_ptr + row * stride
    m, n_finite, masses = _first_pass(row_ptr, V, T, BLOCK, NB)
    no_floor = tl.full((), NEG_INF, tl.float32)
    token, _ = _draw(row_ptr, V, T, seed, tl.full((), 0, tl.int32), masses, m, no_floor,
                     no_floor, BLOCK, NB)
    tau = _threshold(row_ptr, V, T, top_k, top_p, m, n_finite, SUB, NUM_PIVOTS)
    l_s = _scaled(row_ptr, token, V, T)
    done = (top_k == 0) & (top_p >= 1.0) & (tl.exp(l_s - m) >= min_p)  # no filter: s is it
    rnd = tl.full((), 1, tl.int32)
    while not done:
        count_above, mass_above, mass_kept, masses = _round_pass(row_ptr, V, T, l_s, m, tau,
                                                                 min_p, BLOCK, NB)
        done = _accepts(l_s, m, count_above, mass_above, mass_kept, top_k, top_p, min_p)
        if not done:
            next_token, empty = _draw(row_ptr, V, T, seed, rnd, masses, m, l_s, tau, BLOCK, NB)
            # Nothing above a rejected candidate only happens through rounding: keep it then.
            done = empty
            token = tl.where(empty, token, next_token)
            l_s = _scaled(row_ptr, token, V, T)
        rnd += 1
    tl.store(out_ptr + row, token.to(tl.int64))


@triton.jit
def _accepts_kernel(logits_ptr, stride, params_ptr, candidates_ptr, out_ptr, V,
                    BLOCK: tl.constexpr, NB: tl.constexpr, SUB: tl.constexpr,
                    NUM_PIVOTS: tl.constexpr):
    """For tests: would row `pid` accept its candidate token? (the sampler's own decision)"""
    pid = tl.program_id(0)
    T = tl.load(params_ptr + 4 * pid)
    top_k = tl.load(params_ptr + 4 * pid + 1).to(tl.int32)
    top_p = tl.load(params_ptr + 4 * pid + 2)
    min_p = tl.load(params_ptr + 4 * pid + 3)
    row_ptr = logits_ptr + pid * stride
    m, n_finite, _ = _first_pass(row_ptr, V, T, BLOCK, NB)
    tau = _threshold(row_ptr, V, T, top_k, top_p, m, n_finite, SUB, NUM_PIVOTS)
    l_s = _scaled(row_ptr, tl.load(candidates_ptr + pid), V, T)
    count_above, mass_above, mass_kept, _ = _round_pass(row_ptr, V, T, l_s, m, tau, min_p,
                                                        BLOCK, NB)
    ok = _accepts(l_s, m, count_above, mass_above, mass_kept, top_k, top_p, min_p)
    tl.store(out_ptr + pid, ok & (l_s > NEG_INF))


def _launch_args(logits: torch.Tensor, params: torch.Tensor, sub: int, num_warps: int):
    assert logits.dtype == torch.float32 and logits.stride(1) == 1, "fp32 rows, contiguous"
    assert params.dtype == torch.float32 and params.is_contiguous() and params.shape[1] == 4
    block = 4 * sub
    num_blocks = triton.cdiv(logits.shape[1], block)
    return dict(BLOCK=block, NB=max(2, triton.next_power_of_2(num_blocks)), SUB=sub,
                NUM_PIVOTS=NUM_PIVOTS, num_warps=num_warps)


STEP_SEEDS = (2**32, 2**62)  # step seeds in this range are all int64 to Triton: one compile


def sample_rows(logits: torch.Tensor, params: torch.Tensor, ids: torch.Tensor,
                out: torch.Tensor, sub: int = SUB, step_seed: int = STEP_SEEDS[0],
                num_warps: int = NUM_WARPS) -> None:
    """Sample rows of logits [rows, vocab] fp32 into out [rows] int64: program i samples row
    ids[i, 0] with params[i] = (temperature > 0, top_k (0: all), top_p, min_p) (params [n, 4]
    fp32). ids [n, 2] int64: (row, Philox seed); or ids [n, 3]: (row, seed, position), noise
    from splitmix64(seed, position), position then advanced by one in place, or from
    splitmix64(step_seed, row) where position < 0. Rows not in ids are left as they are.
    sub: a block is 4 * sub elements (a power of 2; a seed's tokens depend on it: tests on the
    interpreter use small ones). num_warps: a row's program size (both are tuning knobs:
    lab/bench_sampler.py --sweep)."""
    assert ids.dtype == torch.int64 and ids.is_contiguous() and ids.dim() == 2
    assert ids.shape[0] == params.shape[0] and ids.shape[1] in (2, 3)
    assert STEP_SEEDS[0] <= step_seed < STEP_SEEDS[1]
    if ids.shape[0]:
        _sample_kernel[(ids.shape[0],)](logits, logits.stride(0), params, ids, out,
                                        logits.shape[1], step_seed, MIXED=ids.shape[1] == 3,
                                        **_launch_args(logits, params, sub, num_warps))


# The seen-ids capacity (and row stride) is whatever the longest penalised request needs: not
# specialised, so one variant per BLOCK serves every capacity (the warm-up compiles each BLOCK).
@triton.jit(do_not_specialize=["seen_stride", "capacity"])
def _penalise_kernel(logits_ptr, stride, rows_ptr, slots_ptr, values_ptr, seen_ptr, seen_stride,
                     capacity, lens_ptr, counts_ptr, counts_stride, BLOCK: tl.constexpr):
    """Row rows[pid] of logits, penalty state slots[pid]: every seen id at once (one load of all
    of them before any store, so repeated ids all compute from the unpenalised logit)."""
    pid = tl.program_id(0)
    row = tl.load(rows_ptr + pid)
    slot = tl.load(slots_ptr + pid)
    presence = tl.load(values_ptr + 3 * pid)  # values [P, 3]: presence, frequency, repetition
    frequency = tl.load(values_ptr + 3 * pid + 1)
    repetition = tl.load(values_ptr + 3 * pid + 2)
    offs = tl.arange(0, BLOCK)
    filled = (offs < tl.load(lens_ptr + slot)) & (offs < capacity)
    ids = tl.load(seen_ptr + slot * seen_stride + offs, mask=filled, other=0)
    counts = tl.load(counts_ptr + slot * counts_stride + ids, mask=filled, other=0).to(tl.float32)
    at = logits_ptr + row * stride + ids
    x = tl.load(at, mask=filled, other=0.0)
    x = tl.where(x > 0, tl.math.div_rn(x, repetition), x * repetition)
    x = x - frequency * counts
    x = x - presence * (counts > 0).to(tl.float32)
    tl.store(at, x, mask=filled)


MAX_SEEN_BLOCK = 32768  # seen ids a row beyond which the sampler penalises with torch ops
MIN_SEEN_BLOCK = 1024  # the smallest block: fewer variants for the start-up warm-up to compile


def penalise_block(capacity: int) -> int:
    """The penalty kernel's block (one compiled variant each) for a seen-ids capacity."""
    return max(MIN_SEEN_BLOCK, triton.next_power_of_2(capacity))


def penalise_rows(logits: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                  values: torch.Tensor, seen_ids: torch.Tensor, seen_lens: torch.Tensor,
                  counts: torch.Tensor) -> None:
    """`flashlet.runner.sampler.penalise_seen` in one launch: logits [n, vocab] fp32 in place; rows,
    slots [P] int64 (a penalised row and its penalty state); values [P, 3] fp32 (presence,
    frequency, repetition); seen_ids [slots, capacity] int64 with seen_lens [slots] filled;
    counts [slots, vocab] int32 (output tokens). capacity <= MAX_SEEN_BLOCK."""
    assert logits.dtype == torch.float32 and logits.stride(1) == 1 and values.is_contiguous()
    block = penalise_block(seen_ids.shape[1])
    assert block <= MAX_SEEN_BLOCK and seen_ids.stride(1) == 1 and counts.stride(1) == 1
    if rows.shape[0]:
        # No FMA contraction: the same roundings as the torch reference, op for op.
        _penalise_kernel[(rows.shape[0],)](logits, logits.stride(0), rows, slots, values,
                                           seen_ids, seen_ids.stride(0), seen_ids.shape[1],
                                           seen_lens, counts, counts.stride(0), BLOCK=block,
                                           num_warps=max(1, min(16, block // 512)),
                                           enable_fp_fusion=False)


@triton.jit(do_not_specialize=["seen_stride", "capacity"])
def _record_kernel(tokens_ptr, rows_ptr, slots_ptr, counts_ptr, counts_stride, seen_ptr,
                   seen_stride, lens_ptr, capacity):
    pid = tl.program_id(0)
    slot = tl.load(slots_ptr + pid)
    token = tl.load(tokens_ptr + tl.load(rows_ptr + pid))
    count = counts_ptr + slot * counts_stride + token
    tl.store(count, tl.load(count) + 1)  # one program a slot: no other writes it
    filled = tl.load(lens_ptr + slot)
    tl.store(seen_ptr + slot * seen_stride + tl.minimum(filled, capacity - 1), token)
    tl.store(lens_ptr + slot, filled + 1)


def record_rows(tokens: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor,
                counts: torch.Tensor, seen_ids: torch.Tensor, seen_lens: torch.Tensor) -> None:
    """Penalty states slots [P] (distinct) output tokens[rows] (tokens [n] int64): one more
    count each, and the token appended to their seen ids, in one launch."""
    if rows.shape[0]:
        _record_kernel[(rows.shape[0],)](tokens, rows, slots, counts, counts.stride(0), seen_ids,
                                         seen_ids.stride(0), seen_lens, seen_ids.shape[1],
                                         num_warps=1)


def accepts(logits: torch.Tensor, params: torch.Tensor, candidates: torch.Tensor,
            sub: int = SUB) -> torch.Tensor:
    """For tests: bool [rows], whether the kernel would accept candidates[r] (int64) in row r."""
    out = torch.empty(logits.shape[0], dtype=torch.bool, device=logits.device)
    _accepts_kernel[(logits.shape[0],)](logits, logits.stride(0), params, candidates, out,
                                        logits.shape[1], **_launch_args(logits, params, sub, NUM_WARPS))
    return out
