"""Sort-free exact sampling: temperature, min_p, top_k and top_p in one kernel, one program a row.

Work. Row r of logits [rows, vocab] (fp32) samples one token from the distribution that
`flashlet.sampler.sampling_probs` (the torch reference, vLLM's order) describes: l = logits / T;
min_p drops tokens with exp(l - max) < min_p; top_k keeps l >= the k-th largest (ties with the
k-th kept); top_p then keeps token t when the renormalised mass of the tokens strictly above it is
below top_p; the most likely token always stays; a -inf logit is never picked.

Design (rejection with pivots, the idea behind FlashInfer's sorting-free samplers). Every filter
keeps a top set {l >= threshold}, so the kept set A is one too. Pass 1 finds max(l) and draws a
candidate s from softmax(l) over the whole row by an exponential race (s = argmax l - log(E),
E ~ Exp(1) i.i.d.). Each further pass computes, for the candidate, count(l > l_s), mass(l > l_s)
and the mass of the min_p/top_k-filtered set, which decide whether s is in A, and speculatively
races a next candidate over {l > l_s}. If s is in A it is the token; otherwise every token of A
lies above l_s, so the search restricts to {l > l_s} and goes on with the next candidate. A draw
from softmax restricted to a superset R of A, kept when it falls in A and otherwise redrawn from
a smaller superset with fresh noise, is distributed exactly as softmax restricted to A. On flat
rows (top_p 0.9 keeps ~90% of the vocabulary) the first candidate is accepted ~90% of the time;
on peaked rows the second one nearly always is: about two passes over the row either way.
top_k together with top_p needs the mass of the top-k set, so such rows first find the k-th
largest value tau exactly, by counting against 15 pivots per pass over the values' ordered bits
(~8 passes), and race only over {l >= tau} from then on. top_k alone on a flat row takes about
ln(vocab / top_k) rounds (each rejected candidate cuts what is left by a random fraction).

Noise: Philox (`tl.rand4x`, four numbers per draw) keyed by a per-row 64-bit seed, counter = (the
round, the element): a row's tokens depend only on its seed, never on the batch around it. The
sampler passes (seed, position) per row and the kernel mixes them (splitmix64, as
`flashlet.sampling.noise_seed` on the host) and advances the position itself, so a steady batch
needs no per-row host work: a seeded row's seed is its request's seed and output position, an
unseeded row's the step's random seed and its row.

Split path (`sample_rows_split`, the default). One program a row is 128 programs for 128 rows:
a quarter of an H200's warp slots, each SM streaming a 600 KB row alone (0.34-0.42 ms for the
two to three passes). So each row is cut into C chunks of whole blocks (C ~ 2048 / rows: 15 of
10,240 tokens at 128 x 151,936, 4 warps a program, ~2,000 programs) and every pass is a launch
of n x C programs that writes one partial entry per (row, chunk) into a scratch buffer: the
first pass its chunk's max, finite count and race winner; a round its count, masses and race
winner for the row's candidate; a k-th largest pass its counts against the pivots. The next
launch's programs each combine their row's C entries (a few hundred bytes) to get what the
one-program kernel had in registers (the max, the candidate, the accept decision), so stream
order is the only synchronisation: no atomics, no host sync, a fixed sequence of launches (first
pass, KTH_PASSES k-th largest passes when a row has top_k, SPLIT_ROUNDS rounds, a finisher a
row). A decided row's programs only copy its token on. The finisher writes the token, advances
a seeded row's position, and samples a row still undecided after the split rounds alone, as the
one-program kernel would (about one step in a few hundred of 128 flat rows). Noise is per
(seed, round, token id), whatever the chunks, so a row draws what the one-program kernel draws
(without top_k: the same tokens, but for a decision within fp32 rounding, the sums being in
another order). With top_k the split path finds the k-th largest tau first and races over
{l >= tau} from round 1 on (top_k alone then needs 2 rounds where rejection took ~ln(vocab/k)).

Penalties (`penalise_rows`, `record_rows`): one program a penalised row, over its seen ids (the
sparse form of `flashlet.sampler.apply_penalties`), and after sampling one that adds the row's
token to its counts and seen ids: two launches where torch takes about twenty.

Ties at the top_p boundary: the reference sorts and keeps a prefix, so of several tokens tied
with the last kept one it keeps some (in sort order); here the condition is on the value, so all
of them stay (as top_k's ties do). Masses are fp32 sums in another order than the reference's
cumsum, so a token whose cumulative mass is within rounding of top_p may fall on either side.

Bytes per row: about 2-3 reads of the row (one more per rejected candidate; ~8 more with
top_k and top_p together), fp32. FLOPs per element and pass: a division, two logs and an exp, plus a
quarter of a Philox-4x32-10 draw.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

SUB = 2048  # Philox draws per block; each gives 4 numbers, so a block is 4 * SUB elements
NUM_PIVOTS = 15  # the k-th largest search cuts the interval of candidate values in 16 a pass
KTH_PASSES = tl.constexpr(8)  # 16**8 = 2**32: enough to narrow any interval of ordered bits
SPLIT_SUB = 256  # the split path's blocks: 1024 elements, 4 warps a program
SPLIT_ROUNDS = 4  # split rounds before the finisher (a row needs a 5th one ~1e-4 of the time)
TARGET_PROGRAMS = 2048  # the split path cuts rows in chunks to launch about this many programs
MAX_CHUNKS = 64  # chunks a row at most (the programs of a row combine their entries in one go)
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
def _tile(row_ptr, start, V, T, seed, rnd, SUB: tl.constexpr):
    """One block of 4 * SUB elements: their indices, l = logits / T and uniform noise [SUB, 4].
    Element start + 4 * i + j takes number j of Philox draw (rnd, start / 4 + i)."""
    lanes = tl.arange(0, SUB)[:, None]
    js = tl.arange(0, 4)[None, :]
    offs = start + 4 * lanes + js
    u0, u1, u2, u3 = tl.rand4x(seed, (start // 4 + lanes).to(tl.int64) + (rnd.to(tl.int64) << 32))
    u = tl.where(js == 0, u0, tl.where(js == 1, u1, tl.where(js == 2, u2, u3)))
    return offs, _scaled(row_ptr, offs, V, T), u


@triton.jit
def _first_pass(row_ptr, begin, end, V, T, seed, SUB: tl.constexpr):
    """Over elements [begin, end) (begin a multiple of 4 * SUB): -> max(l), count of finite l,
    and a race winner over every finite l (round 0). Race key: argmax of l - log(E),
    E = -log(u) ~ Exp(1), wins with probability softmax(l)."""
    m = tl.full((), NEG_INF, tl.float32)
    n_finite = tl.full((), 0, tl.int32)
    best_key = tl.full((), NEG_INF, tl.float32)
    best_idx = tl.full((), 0, tl.int32)
    for start in range(begin, end, 4 * SUB):
        offs, l, u = _tile(row_ptr, start, V, T, seed, tl.full((), 0, tl.int32), SUB)
        key = tl.where(l > NEG_INF, l - tl.log(-tl.log(u)), NEG_INF)
        m = tl.maximum(m, tl.max(l))
        n_finite += tl.sum((l > NEG_INF).to(tl.int32))
        tile_key = tl.max(key)
        first = tl.min(tl.where(key == tile_key, offs, 2147483647))
        best_idx = tl.where(tile_key > best_key, first, best_idx)
        best_key = tl.maximum(best_key, tile_key)
    return m, n_finite, best_key, best_idx


@triton.jit
def _round_pass(row_ptr, begin, end, V, T, seed, rnd, l_s, m, tau, min_p, SUB: tl.constexpr):
    """Over elements [begin, end), for candidate value l_s: count(l > l_s), mass(l > l_s), the
    mass of the min_p/top_k-kept set {l >= tau, exp(l - m) >= min_p} (masses relative to
    exp(m)), and the race winner over {l > l_s, l >= tau} with round `rnd`'s noise."""
    count_above = tl.full((), 0, tl.int32)
    mass_above = tl.full((), 0.0, tl.float32)
    mass_kept = tl.full((), 0.0, tl.float32)
    best_key = tl.full((), NEG_INF, tl.float32)
    best_idx = tl.full((), 0, tl.int32)
    for start in range(begin, end, 4 * SUB):
        offs, l, u = _tile(row_ptr, start, V, T, seed, rnd, SUB)
        w = tl.exp(l - m)
        above = l > l_s
        count_above += tl.sum(above.to(tl.int32))
        mass_above += tl.sum(tl.where(above, w, 0.0))
        mass_kept += tl.sum(tl.where((l >= tau) & (w >= min_p), w, 0.0))
        key = tl.where(above & (l >= tau), l - tl.log(-tl.log(u)), NEG_INF)  # still holds A
        tile_key = tl.max(key)
        first = tl.min(tl.where(key == tile_key, offs, 2147483647))
        best_idx = tl.where(tile_key > best_key, first, best_idx)
        best_key = tl.maximum(best_key, tile_key)
    return count_above, mass_above, mass_kept, best_key, best_idx


@triton.jit
def _pivots(lo, hi, NUM_PIVOTS: tl.constexpr):
    """NUM_PIVOTS pivots evenly in the ordered-bits interval [lo, hi) (int64), and hi last."""
    js = tl.arange(0, NUM_PIVOTS + 1)  # one spare column, unused (pivot lists must be a power of 2)
    return lo + (hi - lo) * (js + 1) // (NUM_PIVOTS + 1)


@triton.jit
def _pivot_counts(row_ptr, begin, end, V, T, pivots, SUB: tl.constexpr,
                  NUM_PIVOTS: tl.constexpr):
    """count(ordered bits of l >= pivot) over elements [begin, end), for each pivot."""
    lanes = tl.arange(0, SUB)  # [pivots, SUB] comparisons a step: registers, not 4 * SUB
    narrow = pivots.to(tl.int32)  # the interval lies in int32 (hi - lo does not, always)
    counts = tl.zeros([NUM_PIVOTS + 1], tl.int32)
    for start in range(begin, end, SUB):
        bits = _ordered_bits(_scaled(row_ptr, start + lanes, V, T))
        counts += tl.sum((bits[None, :] >= narrow[:, None]).to(tl.int32), 1)
    return counts


@triton.jit
def _narrow(lo, hi, counts, k, NUM_PIVOTS: tl.constexpr):
    """The next interval, keeping count(l >= lo) >= k > count(l >= hi)."""
    js = tl.arange(0, NUM_PIVOTS + 1)
    pivots = _pivots(lo, hi, NUM_PIVOTS)
    enough = (counts >= k) & (js < NUM_PIVOTS)
    new_lo = tl.maximum(lo, tl.max(tl.where(enough, pivots, lo), 0))
    new_hi = tl.minimum(hi, tl.min(tl.where(enough, hi, pivots), 0))
    return new_lo, new_hi


@triton.jit
def _kth_start(m):
    """The k-th largest search's first interval [lo, hi) of ordered bits (int64)."""
    lo = (_ordered_bits(tl.full((), NEG_INF, tl.float32)) + 1).to(tl.int64)  # least finite
    hi = _ordered_bits(m).to(tl.int64) + 1
    return lo, hi


@triton.jit
def _from_ordered_bits(lo):
    bits = lo.to(tl.int32)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.float32, bitcast=True)


@triton.jit
def _kth_largest(row_ptr, V, T, k, m, SUB: tl.constexpr, NUM_PIVOTS: tl.constexpr):
    """The k-th largest l of the row (needs k <= its count of finite l), exactly: bisection over
    the ordered bits with NUM_PIVOTS pivots a pass, keeping count(l >= lo) >= k > count(l >= hi)."""
    lo, hi = _kth_start(m)
    while hi - lo > 1:
        counts = _pivot_counts(row_ptr, 0, V, V, T, _pivots(lo, hi, NUM_PIVOTS), SUB, NUM_PIVOTS)
        lo, hi = _narrow(lo, hi, counts, k, NUM_PIVOTS)
    return _from_ordered_bits(lo)


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
    """flashlet.sampling._splitmix64 of two int64s (63 bits out), in wrapping uint64 arithmetic."""
    z = a.to(tl.uint64, bitcast=True) * tl.full((), 0x9E3779B97F4A7C15, tl.uint64)
    z = z + b.to(tl.uint64, bitcast=True) + tl.full((), 0x632BE59BD9B4E5B, tl.uint64)
    z = (z ^ (z >> 30)) * tl.full((), 0xBF58476D1CE4E5B9, tl.uint64)
    z = (z ^ (z >> 27)) * tl.full((), 0x94D049BB133111EB, tl.uint64)
    return ((z ^ (z >> 31)) >> 1).to(tl.int64, bitcast=True)


@triton.jit
def _row_seed(ids_ptr, pid, step_seed, MIXED: tl.constexpr, ADVANCE: tl.constexpr = True):
    """-> (row of logits, Philox seed). ids [n, 2]: (row, seed); MIXED, ids [n, 3]: (row, seed,
    position), the seed splitmix64(seed, position) and (ADVANCE) the position advanced in place,
    or, for a position < 0 (an unseeded row), splitmix64(step_seed, row)."""
    if MIXED:
        row = tl.load(ids_ptr + 3 * pid)
        base = tl.load(ids_ptr + 3 * pid + 1)
        position = tl.load(ids_ptr + 3 * pid + 2)
        seeded = position >= 0
        seed = _splitmix64(tl.where(seeded, base, step_seed), tl.where(seeded, position, row))
        if ADVANCE:
            if seeded:
                tl.store(ids_ptr + 3 * pid + 2, position + 1)
    else:
        row = tl.load(ids_ptr + 2 * pid)
        seed = tl.load(ids_ptr + 2 * pid + 1)
    return row, seed


@triton.jit
def _row_params(params_ptr, pid):
    """params [n, 4] fp32: temperature, top_k, top_p, min_p."""
    T = tl.load(params_ptr + 4 * pid)
    top_k = tl.load(params_ptr + 4 * pid + 1).to(tl.int32)
    top_p = tl.load(params_ptr + 4 * pid + 2)
    min_p = tl.load(params_ptr + 4 * pid + 3)
    return T, top_k, top_p, min_p


@triton.jit(do_not_specialize=["step_seed"])
def _sample_kernel(logits_ptr, stride, params_ptr, ids_ptr, out_ptr, V, step_seed,
                   SUB: tl.constexpr, NUM_PIVOTS: tl.constexpr, MIXED: tl.constexpr):
    pid = tl.program_id(0)
    row, seed = _row_seed(ids_ptr, pid, step_seed, MIXED)
    T, top_k, top_p, min_p = _row_params(params_ptr, pid)
    row_ptr = logits_ptr + row * stride
    m, n_finite, best_key, token = _first_pass(row_ptr, 0, V, V, T, seed, SUB)
    tau = _threshold(row_ptr, V, T, top_k, top_p, m, n_finite, SUB, NUM_PIVOTS)
    l_s = _scaled(row_ptr, token, V, T)
    done = (top_k == 0) & (top_p >= 1.0) & (tl.exp(l_s - m) >= min_p)  # no filter: s is it
    rnd = tl.full((), 1, tl.int32)
    while not done:
        count_above, mass_above, mass_kept, next_key, next_token = _round_pass(
            row_ptr, 0, V, V, T, seed, rnd, l_s, m, tau, min_p, SUB)
        # Nothing above a rejected candidate only happens through rounding: keep it then.
        done = _accepts(l_s, m, count_above, mass_above, mass_kept, top_k, top_p, min_p) | (
            next_key == NEG_INF)
        token = tl.where(done, token, next_token)
        l_s = _scaled(row_ptr, token, V, T)
        rnd += 1
    tl.store(out_ptr + row, token.to(tl.int64))


@triton.jit
def _accepts_kernel(logits_ptr, stride, params_ptr, candidates_ptr, out_ptr, V,
                    SUB: tl.constexpr, NUM_PIVOTS: tl.constexpr):
    """For tests: would row `pid` accept its candidate token? (the sampler's own decision)"""
    pid = tl.program_id(0)
    T, top_k, top_p, min_p = _row_params(params_ptr, pid)
    row_ptr = logits_ptr + pid * stride
    seed = tl.full((), 0, tl.int64)  # noise unused: only the counts and masses matter here
    m, n_finite, _, _ = _first_pass(row_ptr, 0, V, V, T, seed, SUB)
    tau = _threshold(row_ptr, V, T, top_k, top_p, m, n_finite, SUB, NUM_PIVOTS)
    l_s = _scaled(row_ptr, tl.load(candidates_ptr + pid), V, T)
    first_round = tl.full((), 1, tl.int32)
    count_above, mass_above, mass_kept, _, _ = _round_pass(row_ptr, 0, V, V, T, seed, first_round,
                                                           l_s, m, tau, min_p, SUB)
    ok = _accepts(l_s, m, count_above, mass_above, mass_kept, top_k, top_p, min_p)
    tl.store(out_ptr + pid, ok & (l_s > NEG_INF))


# ---- the split path: each row over several programs ---------------------------------------
# Scratch, int32 [n, SLOTS, C, WORDS]: one entry a (row, chunk) per slot. Slot 0: the first
# pass; slots 1-2: the k-th largest passes (in turn); slots 3-4: the rounds (in turn). A launch
# reads the entries the launch before wrote (every program of a row combines them itself: C
# entries, next to nothing) and writes its own: no atomics, no spin, stream order is the sync.
SLOTS = tl.constexpr(5)
WORDS = tl.constexpr(32)
F_STATE = tl.constexpr(0)  # rounds: 1 once the row's token is decided
F_TOKEN = tl.constexpr(1)  # rounds: the candidate (or the token, decided)
F_IDX = tl.constexpr(2)  # the chunk's race winner
F_COUNT = tl.constexpr(3)  # first pass: finite l; rounds: l > l_s
F_KEY = tl.constexpr(4)  # the chunk's race key (fp32 bits, as the masses and max)
F_MASS_ABOVE = tl.constexpr(5)
F_MASS_KEPT = tl.constexpr(6)
F_MAX = tl.constexpr(7)  # first pass: the chunk's max l
F_LO = tl.constexpr(8)  # k-th largest passes: the interval [lo, hi) this pass counted in,
F_HI = tl.constexpr(9)
F_COUNTS = tl.constexpr(16)  # and its NUM_PIVOTS + 1 counts
KTH_SLOT = tl.constexpr(1)
ROUND_SLOT = tl.constexpr(3)


@triton.jit
def _entries(scratch_ptr, pid, slot, C):
    """The row's entries of one slot (entry c at + c * WORDS)."""
    return scratch_ptr + (pid * SLOTS + slot).to(tl.int64) * C * WORDS


@triton.jit
def _ints(base, field, C, CMAX: tl.constexpr, other):
    cs = tl.arange(0, CMAX)
    return tl.load(base + cs * WORDS + field, mask=cs < C, other=other)


@triton.jit
def _floats(base, field, C, CMAX: tl.constexpr, other):
    cs = tl.arange(0, CMAX)
    x = tl.load(base + cs * WORDS + field, mask=cs < C, other=0).to(tl.float32, bitcast=True)
    return tl.where(cs < C, x, other)


@triton.jit
def _race_winner(base, C, CMAX: tl.constexpr):
    """The row's race winner from its chunks' (chunks hold ascending ids: ties -> least id)."""
    keys = _floats(base, F_KEY, C, CMAX, NEG_INF)
    best = tl.max(keys)
    return best, tl.min(tl.where(keys == best, _ints(base, F_IDX, C, CMAX, 2147483647),
                                 2147483647))


@triton.jit
def _first_totals(scratch_ptr, pid, C, CMAX: tl.constexpr):
    """-> max(l), count of finite l, the round-0 race winner (key, token): the first pass's."""
    base = _entries(scratch_ptr, pid, 0, C)
    key, token = _race_winner(base, C, CMAX)
    return (tl.max(_floats(base, F_MAX, C, CMAX, NEG_INF)),
            tl.sum(_ints(base, F_COUNT, C, CMAX, 0)), key, token)


@triton.jit
def _kth_interval(scratch_ptr, pid, slot, C, k, CMAX: tl.constexpr, NUM_PIVOTS: tl.constexpr):
    """The k-th largest search's interval after the pass whose counts are in `slot`."""
    base = _entries(scratch_ptr, pid, slot, C)
    lo = tl.load(base + F_LO).to(tl.int64)
    hi = tl.load(base + F_HI).to(tl.int64)
    if hi - lo > 1:
        cs = tl.arange(0, CMAX)[:, None]
        js = tl.arange(0, NUM_PIVOTS + 1)[None, :]
        counts = tl.sum(tl.load(base + cs * WORDS + F_COUNTS + js, mask=cs < C, other=0), 0)
        lo, hi = _narrow(lo, hi, counts, k, NUM_PIVOTS)
    return lo, hi


@triton.jit
def _split_tau(scratch_ptr, pid, C, top_k, n_finite, HAS_TAU: tl.constexpr,
               CMAX: tl.constexpr, NUM_PIVOTS: tl.constexpr):
    """A top_k row's k-th largest l (from the last k-th largest pass), -inf for other rows: the
    split rounds race over {l >= tau} from the start, so a top_k row is done in ~2 rounds."""
    tau = tl.full((), NEG_INF, tl.float32)
    if HAS_TAU:
        if (top_k > 0) & (top_k < n_finite):
            lo, hi = _kth_interval(scratch_ptr, pid, KTH_SLOT + (KTH_PASSES - 1) % 2, C, top_k,
                                   CMAX, NUM_PIVOTS)
            tau = _from_ordered_bits(lo)
    return tau


@triton.jit
def _unsplit(top_k, n_finite, HAS_TAU: tl.constexpr):
    """A top_k row without the k-th largest passes: the finisher samples it alone."""
    unsplit = (top_k > 0) & (top_k < n_finite)
    if HAS_TAU:
        unsplit = tl.full((), False, tl.int1)
    return unsplit


@triton.jit
def _decide(scratch_ptr, pid, r, C, row_ptr, V, T, top_k, top_p, min_p, m, first_token,
            CMAX: tl.constexpr):
    """Before round r (r >= 1): (is the row's token decided, the token or the next candidate),
    from round r - 1's entries (round 0: the first pass)."""
    if r == 1:
        token = first_token
        l_s = _scaled(row_ptr, token, V, T)
        done = (top_k == 0) & (top_p >= 1.0) & (tl.exp(l_s - m) >= min_p)  # no filter: s is it
    else:
        base = _entries(scratch_ptr, pid, ROUND_SLOT + (r - 1) % 2, C)
        token = tl.load(base + F_TOKEN)
        next_key, next_token = _race_winner(base, C, CMAX)
        l_s = _scaled(row_ptr, token, V, T)
        # Nothing above a rejected candidate only happens through rounding: keep it then.
        done = (tl.load(base + F_STATE) == 1) | (next_key == NEG_INF) | _accepts(
            l_s, m, tl.sum(_ints(base, F_COUNT, C, CMAX, 0)),
            tl.sum(_floats(base, F_MASS_ABOVE, C, CMAX, 0.0)),
            tl.sum(_floats(base, F_MASS_KEPT, C, CMAX, 0.0)), top_k, top_p, min_p)
        token = tl.where(done, token, next_token)
    return done, token


@triton.jit(do_not_specialize=["step_seed", "C", "chunk"])
def _split_first_kernel(logits_ptr, stride, params_ptr, ids_ptr, scratch_ptr, V, C, chunk,
                        step_seed, SUB: tl.constexpr, MIXED: tl.constexpr):
    """Program (i, c): the first pass over chunk c of row ids[i]."""
    pid = tl.program_id(0)
    c = tl.program_id(1)
    row, seed = _row_seed(ids_ptr, pid, step_seed, MIXED, False)
    T = tl.load(params_ptr + 4 * pid)
    begin = c * chunk
    m, n_finite, key, token = _first_pass(logits_ptr + row * stride, begin,
                                          tl.minimum(begin + chunk, V), V, T, seed, SUB)
    out = _entries(scratch_ptr, pid, 0, C) + c * WORDS
    tl.store(out + F_MAX, m.to(tl.int32, bitcast=True))
    tl.store(out + F_COUNT, n_finite)
    tl.store(out + F_KEY, key.to(tl.int32, bitcast=True))
    tl.store(out + F_IDX, token)


@triton.jit(do_not_specialize=["C", "chunk", "j"])
def _split_kth_kernel(logits_ptr, stride, params_ptr, ids_ptr, scratch_ptr, V, C, chunk, j,
                      SUB: tl.constexpr, NUM_PIVOTS: tl.constexpr, CMAX: tl.constexpr,
                      MIXED: tl.constexpr):
    """Program (i, c): pass j of a top_k row's k-th largest search over chunk c (NUM_PIVOTS
    pivots; KTH_PASSES passes always narrow the < 2**32 interval to one value)."""
    pid = tl.program_id(0)
    c = tl.program_id(1)
    if MIXED:
        row = tl.load(ids_ptr + 3 * pid)
    else:
        row = tl.load(ids_ptr + 2 * pid)
    T, top_k, top_p, min_p = _row_params(params_ptr, pid)
    m, n_finite, _, _ = _first_totals(scratch_ptr, pid, C, CMAX)
    if (top_k > 0) & (top_k < n_finite):
        if j == 0:
            lo, hi = _kth_start(m)
        else:
            lo, hi = _kth_interval(scratch_ptr, pid, KTH_SLOT + (j - 1) % 2, C, top_k, CMAX,
                                   NUM_PIVOTS)
        out = _entries(scratch_ptr, pid, KTH_SLOT + j % 2, C) + c * WORDS
        tl.store(out + F_LO, lo.to(tl.int32))
        tl.store(out + F_HI, hi.to(tl.int32))
        if hi - lo > 1:
            begin = c * chunk
            counts = _pivot_counts(logits_ptr + row * stride, begin, tl.minimum(begin + chunk, V),
                                   V, T, _pivots(lo, hi, NUM_PIVOTS), SUB, NUM_PIVOTS)
            tl.store(out + F_COUNTS + tl.arange(0, NUM_PIVOTS + 1), counts)


@triton.jit(do_not_specialize=["step_seed", "C", "chunk", "r"])
def _split_round_kernel(logits_ptr, stride, params_ptr, ids_ptr, scratch_ptr, V, C, chunk, r,
                        step_seed, SUB: tl.constexpr, NUM_PIVOTS: tl.constexpr,
                        CMAX: tl.constexpr, MIXED: tl.constexpr, HAS_TAU: tl.constexpr):
    """Program (i, c): decide row ids[i]'s candidate from round r - 1, and if it is rejected,
    round r over chunk c for the next one (the sums of `_round_pass`, split by chunk)."""
    pid = tl.program_id(0)
    c = tl.program_id(1)
    row, seed = _row_seed(ids_ptr, pid, step_seed, MIXED, False)
    T, top_k, top_p, min_p = _row_params(params_ptr, pid)
    row_ptr = logits_ptr + row * stride
    m, n_finite, _, first_token = _first_totals(scratch_ptr, pid, C, CMAX)
    if not _unsplit(top_k, n_finite, HAS_TAU):
        tau = _split_tau(scratch_ptr, pid, C, top_k, n_finite, HAS_TAU, CMAX, NUM_PIVOTS)
        done, token = _decide(scratch_ptr, pid, r, C, row_ptr, V, T, top_k, top_p, min_p, m,
                              first_token, CMAX)
        out = _entries(scratch_ptr, pid, ROUND_SLOT + r % 2, C) + c * WORDS
        tl.store(out + F_TOKEN, token)
        tl.store(out + F_STATE, done.to(tl.int32))
        count_above = tl.full((), 0, tl.int32)  # a decided row's sums: defined, and unused
        mass_above = tl.full((), 0.0, tl.float32)
        mass_kept = tl.full((), 0.0, tl.float32)
        key = tl.full((), NEG_INF, tl.float32)
        idx = tl.full((), 0, tl.int32)
        if not done:
            begin = c * chunk
            count_above, mass_above, mass_kept, key, idx = _round_pass(
                row_ptr, begin, tl.minimum(begin + chunk, V), V, T, seed, r,
                _scaled(row_ptr, token, V, T), m, tau, min_p, SUB)
        tl.store(out + F_COUNT, count_above)
        tl.store(out + F_MASS_ABOVE, mass_above.to(tl.int32, bitcast=True))
        tl.store(out + F_MASS_KEPT, mass_kept.to(tl.int32, bitcast=True))
        tl.store(out + F_KEY, key.to(tl.int32, bitcast=True))
        tl.store(out + F_IDX, idx)


@triton.jit(do_not_specialize=["step_seed", "C", "rounds"])
def _split_finish_kernel(logits_ptr, stride, params_ptr, ids_ptr, scratch_ptr, V, C, out_ptr,
                         rounds, step_seed, SUB: tl.constexpr, NUM_PIVOTS: tl.constexpr,
                         CMAX: tl.constexpr, MIXED: tl.constexpr, HAS_TAU: tl.constexpr):
    """Program i: row ids[i]'s token after `rounds` split rounds; a row still undecided (rare:
    a few times in a thousand steps of 128 rows) goes on alone, as `_sample_kernel` does."""
    pid = tl.program_id(0)
    row, seed = _row_seed(ids_ptr, pid, step_seed, MIXED, True)
    T, top_k, top_p, min_p = _row_params(params_ptr, pid)
    row_ptr = logits_ptr + row * stride
    m, n_finite, _, token = _first_totals(scratch_ptr, pid, C, CMAX)
    if _unsplit(top_k, n_finite, HAS_TAU):
        tau = _threshold(row_ptr, V, T, top_k, top_p, m, n_finite, SUB, NUM_PIVOTS)
        done, token = _decide(scratch_ptr, pid, 1, C, row_ptr, V, T, top_k, top_p, min_p, m,
                              token, CMAX)
        rnd = tl.full((), 1, tl.int32)
    else:
        tau = _split_tau(scratch_ptr, pid, C, top_k, n_finite, HAS_TAU, CMAX, NUM_PIVOTS)
        done, token = _decide(scratch_ptr, pid, rounds + 1, C, row_ptr, V, T, top_k, top_p,
                              min_p, m, token, CMAX)
        rnd = (rounds + 1).to(tl.int32)
    l_s = _scaled(row_ptr, token, V, T)
    while not done:
        count_above, mass_above, mass_kept, next_key, next_token = _round_pass(
            row_ptr, 0, V, V, T, seed, rnd, l_s, m, tau, min_p, SUB)
        done = _accepts(l_s, m, count_above, mass_above, mass_kept, top_k, top_p, min_p) | (
            next_key == NEG_INF)
        token = tl.where(done, token, next_token)
        l_s = _scaled(row_ptr, token, V, T)
        rnd += 1
    tl.store(out_ptr + row, token.to(tl.int64))


def _launch_args(logits: torch.Tensor, params: torch.Tensor, sub: int):
    assert logits.dtype == torch.float32 and logits.stride(1) == 1, "fp32 rows, contiguous"
    assert params.dtype == torch.float32 and params.is_contiguous() and params.shape[1] == 4
    # 16 warps a row with 2048-draw blocks: 0.400 ms for 128 x 151,936 flat rows on the H200
    # against 0.498 with 8 warps and 1024 (grid of 4 to 32 warps x 256 to 2048, 2026-11-30).
    return dict(SUB=sub, NUM_PIVOTS=NUM_PIVOTS, num_warps=16)


STEP_SEEDS = (2**32, 2**62)  # step seeds in this range are all int64 to Triton: one compile


def sample_rows(logits: torch.Tensor, params: torch.Tensor, ids: torch.Tensor,
                out: torch.Tensor, sub: int | None = None, step_seed: int = STEP_SEEDS[0],
                split: bool = True, top_k: bool = True, chunks: int | None = None,
                rounds: int = SPLIT_ROUNDS) -> None:
    """Sample rows of logits [rows, vocab] fp32 into out [rows] int64: row ids[i, 0] with
    params[i] = (temperature > 0, top_k (0: all), top_p, min_p) (params [n, 4] fp32). ids
    [n, 2] int64: (row, Philox seed); or ids [n, 3]: (row, seed, position), noise from
    splitmix64(seed, position), position then advanced by one in place, or from
    splitmix64(step_seed, row) where position < 0. Rows not in ids are left as they are.

    split (the default): each row over several programs (`sample_rows_split`); False: one
    program a row (`_sample_kernel`, kept for comparison). Both draw the same noise for a
    (seed, round, token), so they mostly agree token for token. top_k False: no row has a top_k
    (then the split path skips the k-th largest passes; a row that has one is still sampled
    exactly, alone, by the finisher). sub: the block width (a power of 2; small ones for tests
    on the interpreter); chunks, rounds: the split path's layout (benchmarks)."""
    assert ids.dtype == torch.int64 and ids.is_contiguous() and ids.dim() == 2
    assert ids.shape[0] == params.shape[0] and ids.shape[1] in (2, 3)
    assert STEP_SEEDS[0] <= step_seed < STEP_SEEDS[1]
    if not ids.shape[0]:
        return
    if split:
        sample_rows_split(logits, params, ids, out, sub, step_seed, top_k, chunks, rounds)
        return
    _sample_kernel[(ids.shape[0],)](logits, logits.stride(0), params, ids, out,
                                    logits.shape[1], step_seed, MIXED=ids.shape[1] == 3,
                                    **_launch_args(logits, params, sub or SUB))


def split_layout(rows: int, vocab: int, sub: int = SPLIT_SUB,
                 chunks: int | None = None) -> tuple[int, int]:
    """-> (chunks a row, elements a chunk: whole blocks of 4 * sub) for the split path."""
    block = 4 * sub
    blocks = triton.cdiv(vocab, block)
    want = min(chunks or max(1, TARGET_PROGRAMS // rows), MAX_CHUNKS, blocks)
    per_chunk = triton.cdiv(blocks, want)
    return triton.cdiv(blocks, per_chunk), per_chunk * block


def sample_rows_split(logits: torch.Tensor, params: torch.Tensor, ids: torch.Tensor,
                      out: torch.Tensor, sub: int | None = None,
                      step_seed: int = STEP_SEEDS[0], top_k: bool = True,
                      chunks: int | None = None, rounds: int = SPLIT_ROUNDS) -> None:
    """`sample_rows` with each row cut in C chunks, one program each (a grid of n x C, so 128
    rows fill the GPU where one program a row used a quarter of it): the first pass; with
    top_k, KTH_PASSES passes of the k-th largest search; `rounds` rounds; then a finisher, one
    program a row, that writes the token (and goes on alone with a row still undecided). Every
    launch is queued at once: no host sync, and a fixed sequence (graph-capturable)."""
    n, vocab = ids.shape[0], logits.shape[1]
    assert rounds >= 1
    split_sub = sub or SPLIT_SUB
    if chunks is None and logits.device.type == "cpu":
        chunks = 2  # the interpreter runs programs one by one: more only cost it time
    C, chunk = split_layout(n, vocab, split_sub, chunks)
    scratch = torch.empty(n * SLOTS.value * C * WORDS.value, dtype=torch.int32,
                          device=logits.device)
    common = (logits, logits.stride(0), params, ids, scratch, vocab, C)
    _launch_args(logits, params, split_sub)  # the argument checks
    mixed = ids.shape[1] == 3
    _split_first_kernel[(n, C)](*common, chunk, step_seed, SUB=split_sub, MIXED=mixed,
                                num_warps=4)
    for j in range(KTH_PASSES.value if top_k else 0):
        _split_kth_kernel[(n, C)](*common, chunk, j, SUB=split_sub, NUM_PIVOTS=NUM_PIVOTS,
                                  CMAX=MAX_CHUNKS, MIXED=mixed, num_warps=4)
    for r in range(1, rounds + 1):
        _split_round_kernel[(n, C)](*common, chunk, r, step_seed, SUB=split_sub,
                                    NUM_PIVOTS=NUM_PIVOTS, CMAX=MAX_CHUNKS, MIXED=mixed,
                                    HAS_TAU=top_k, num_warps=4)
    _split_finish_kernel[(n,)](*common, out, rounds, step_seed, SUB=sub or SUB,
                               NUM_PIVOTS=NUM_PIVOTS, CMAX=MAX_CHUNKS, MIXED=mixed,
                               HAS_TAU=top_k, num_warps=16)


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
    """`flashlet.sampler.penalise_seen` in one launch: logits [n, vocab] fp32 in place; rows,
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
                                        logits.shape[1], **_launch_args(logits, params, sub))
    return out
