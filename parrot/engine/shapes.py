"""Step shapes: the padding buckets of the JAX global-JIT design. A step of any size runs on a precompiled
shape that holds it (flat tokens, sequences, queries per sequence, page-table width); `ShapeBook` says
which shape a step pads to, and lists every shape the serving loop may use (what precompile compiles)."""

from __future__ import annotations

from dataclasses import dataclass, field

from parrot.config import EngineConfig
from parrot.engine.batch import pick_bucket
from parrot.engine.sampling import GREEDY, PLAIN, Stages

# token buckets below this serve one sequence's prefill only (a short fill, a grammar's forced tokens); a
# batch of several fills pads to at least this many tokens each (half the small shapes to compile)
MIN_BATCHED_Q = 16


@dataclass(frozen=True)
class Shape:
    """A compiled forward shape: flat tokens, sequences, queries per sequence, pages per sequence."""

    tokens: int
    batch: int
    q_len: int
    pages: int
    prefix_pages: int = 0  # > 0: cascade decode with a shared prefix of this many pages
    steps: int = 1  # > 1: that many decode steps in one call (multi-step decode: `ShapeBook.multi_shape`)
    # a loop whose sampler parts the host names (`sampling.Stages`; None: decided on the device)
    sampler: Stages | None = None


@dataclass(frozen=True)
class ShapeBook:
    """The shapes of one engine: its bucket lists (`ecfg`), its context length `max_len` (a multiple of the
    page size), and what its runner can do: attention that reads the KV pages in place (`in_place`: the
    page-table width then costs nothing, so every step takes the one width of `max_len`, and several prompts
    share one flat token bucket), mixed steps, multi-step decode (`multi_step` steps a call, for batches up
    to `multi_max_batch`; with `host_stages`, a loop per set of sampler parts (`sampling.Stages`) and a fixed
    count of steps, so that nothing in it waits on the host: greedy and plain-temperature loops are listed)."""

    ecfg: EngineConfig
    max_len: int
    in_place: bool
    mixed: bool = False
    multi_step: int = 1
    multi_max_batch: int = 0
    host_stages: bool = False
    kv_buckets: list[int] = field(init=False)  # the attended-length buckets, the last one max_len

    def __post_init__(self) -> None:
        if self.max_len % self.page_size:
            raise ValueError(f"model context {self.max_len} is not a multiple of page_size {self.page_size}")
        # where attention reads the pages in place, a step's cost follows its sequences' lengths, not its
        # page-table width: one width (the model's length) serves every step, and the KV buckets would only
        # multiply the shapes to compile and hold (x6 with the default buckets)
        buckets = [self.max_len] if self.in_place else [b for b in self.ecfg.kv_buckets if b < self.max_len]
        object.__setattr__(self, "kv_buckets", sorted({*buckets, self.max_len}))

    @property
    def page_size(self) -> int:
        return self.ecfg.page_size

    def kv_pages_bucket(self, kv_len: int) -> int:
        return pick_bucket(kv_len, self.kv_buckets) // self.page_size

    def prefill_shape(self, batch: int, q_len: int, kv_len: int, tokens: int | None = None) -> Shape:
        """`batch` sequences of up to `q_len` new tokens each (`tokens` in all), attending to up to `kv_len`
        tokens. Where attention reads the pages in place, several sequences are padded to the bucket of
        their total tokens (the products' rows), each allowed up to all of them; elsewhere every sequence
        is padded to the longest chunk's bucket (the gathered attention's shape)."""
        b = pick_bucket(batch, self.ecfg.prefill_bs_buckets)
        if b > 1 and self.in_place:
            t = pick_bucket(max(tokens if tokens is not None else batch * q_len, q_len, MIN_BATCHED_Q),
                            self.ecfg.token_buckets)
            return Shape(t, b, t, self.kv_pages_bucket(max(kv_len, t)))
        q = pick_bucket(q_len if b == 1 else max(q_len, MIN_BATCHED_Q), self.ecfg.token_buckets)
        return Shape(b * q, b, q, self.kv_pages_bucket(max(kv_len, q)))

    def decode_shape(self, batch: int, kv_len: int) -> Shape:
        b = pick_bucket(batch, self.ecfg.bs_buckets)
        return Shape(b, b, 1, self.kv_pages_bucket(kv_len))

    def mixed_shape(self, batch: int, tokens: int, kv_len: int) -> Shape | None:
        """A mixed step's shape (`batch` sequences, decode rows and prompt chunks, `tokens` in all): a flat
        prefill shape; beyond the prefill batch buckets, a batch bucket with the longest KV bucket (attention
        reads the pages in place, so the page-table width costs nothing: one KV bucket per batch size).
        None: no such bucket."""
        if tokens > self.ecfg.token_buckets[-1]:
            return None
        if batch <= self.ecfg.prefill_bs_buckets[-1]:
            return self.prefill_shape(batch, tokens, kv_len, tokens)
        if batch > self.ecfg.bs_buckets[-1]:
            return None
        b = pick_bucket(batch, self.ecfg.bs_buckets)
        t = pick_bucket(max(tokens, MIN_BATCHED_Q), self.ecfg.token_buckets)
        return Shape(t, b, t, self.max_len // self.page_size)

    def mixed_shapes(self) -> list[Shape]:
        """The mixed shapes beyond the prefill batch buckets: decode batch sizes beside a prompt chunk of up to
        `prefill_tokens_beside_decodes` tokens."""
        if not self.mixed:
            return []
        beside = self.ecfg.prefill_tokens_beside_decodes or self.ecfg.max_num_batched_tokens
        max_bs = pick_bucket(self.ecfg.max_batch_size, self.ecfg.bs_buckets)
        top = self.ecfg.token_buckets[-1]
        shapes = []
        for b in self.ecfg.bs_buckets:
            if b <= self.ecfg.prefill_bs_buckets[-1] or b > max_bs:
                continue
            most = pick_bucket(min(top, b + beside), self.ecfg.token_buckets)  # b decode rows and the chunk
            shapes += [Shape(t, b, t, self.max_len // self.page_size) for t in self.ecfg.token_buckets
                       if max(MIN_BATCHED_Q, b // 2) <= t <= most]
        return shapes

    def multi_shape(self, batch: int, kv_len: int, stages: Stages = GREEDY) -> Shape | None:
        """The shape running `multi_step` decode steps of `batch` sequences in one call, their KV growing to
        at most `kv_len`, sampling with the parts `stages` (where the host names them); None where
        multi-step decode is off, or no bucket holds the batch."""
        if self.multi_step <= 1 or batch > self.multi_max_batch or kv_len > self.max_len:
            return None
        b = pick_bucket(batch, self.ecfg.bs_buckets)
        return Shape(b, b, 1, self.kv_pages_bucket(kv_len), steps=self.multi_step,
                     sampler=stages if self.host_stages else None)

    def cascade_shape(self, batch: int, own_len: int, prefix_len: int) -> Shape | None:
        """Decode shape with a shared prefix, or None when the own KV exceeds the cascade buckets."""
        if own_len > self.ecfg.cascade_suffix_buckets[-1] or batch < 2:
            return None
        b = pick_bucket(batch, self.ecfg.bs_buckets)
        own = pick_bucket(own_len, self.ecfg.cascade_suffix_buckets) // self.page_size
        return Shape(b, b, 1, own, self.kv_pages_bucket(prefix_len))

    def all_shapes(self) -> list[Shape]:
        """Every shape the serving loop may use: prefill steps (`prefill_bs_buckets` sequences of a token
        bucket each, within max_num_batched_tokens), decode batches, mixed steps, multi-step decode loops and
        cascade (shared-prefix) decodes."""
        budget = self.ecfg.max_num_batched_tokens
        max_q = min(self.max_len, pick_bucket(budget, self.ecfg.token_buckets))
        flat = self.in_place  # several sequences share one token bucket (see prefill_shape)
        shapes = [Shape(q if flat else b * q, b, q, kv // self.page_size)
                  for q in self.ecfg.token_buckets if q <= max_q
                  for b in self.ecfg.prefill_bs_buckets
                  if b == 1 or (MIN_BATCHED_Q <= q and (flat or b * q <= budget))
                  for kv in self.kv_buckets if kv >= q]
        max_bs = pick_bucket(self.ecfg.max_batch_size, self.ecfg.bs_buckets)
        decode_bs = [b for b in self.ecfg.bs_buckets if b <= max_bs]
        shapes += [Shape(b, b, 1, kv // self.page_size) for b in decode_bs for kv in self.kv_buckets]
        shapes += self.mixed_shapes()
        if self.multi_step > 1:
            samplers = (GREEDY, PLAIN) if self.host_stages else (None,)
            shapes += list(dict.fromkeys(Shape(b, b, 1, kv // self.page_size, steps=self.multi_step, sampler=st)
                                         for st in samplers
                                         for b in decode_bs if b <= pick_bucket(self.multi_max_batch,
                                                                                self.ecfg.bs_buckets)
                                         for kv in self.kv_buckets))
        if self.ecfg.shared_prefix_attention:
            shapes += [Shape(b, b, 1, own // self.page_size, kv // self.page_size) for b in decode_bs if b >= 2
                       for own in self.ecfg.cascade_suffix_buckets for kv in self.kv_buckets]
        return shapes
