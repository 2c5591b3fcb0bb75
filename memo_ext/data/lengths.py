"""Document-length distributions: a small spec language of mixtures, lengths files, and
documents cut at a context length, for HotSPa's planning and benchmarks.

Document lengths in tokens, drawn from mixtures written in a small spec
language (``--distribution NAME=SPEC`` of ``memo_ext/benchmarks/hotspa_strategies.py``)::

    SPEC      := TERM ("+" TERM)*
    TERM      := [WEIGHT "*"] COMPONENT "(" ARG ("," ARG)* ")"
    ARG       := [NAME "="] NUMBER             # positional in the order below
    lognormal(median, sigma)   exp(N(ln median, sigma²))
    pareto(xm, alpha)          xm · U^(-1/alpha): at least xm, P(> x) = (xm / x)^alpha
    uniform(lo, hi)            uniform in [lo, hi]

Weights are relative (an omitted weight is 1) and are normalised to sum to 1; each draw is
rounded to the nearest whole token, at least 1. Built in:

- ``commoncrawl``: log-normal with median 300 tokens and 98% of documents at most 4,096 tokens,
  the two figures we take for CommonCrawl web pages (σ derived at ``COMMONCRAWL_SIGMA``).
- ``github``: code files, ``0.9*lognormal(median=1000,sigma=1.4)+0.1*pareto(xm=8192,alpha=1.5)``.
  **These parameters are our assumption, not fitted to data**: a log-normal body of ordinary
  source files (median about 1K tokens) and a Pareto tail of long files (generated code, data
  files) holding most of the tokens; about 76% of files are at most 4K tokens and about 2% are
  longer than 32K.
- ``control``: ``uniform(16384,32768)``: every document at least 16K tokens, so buckets shorter
  than 16K stay empty and HotSPa should gain about 1.0×.

``--lengths-file PATH`` reads measured lengths instead (one positive integer per line, blank
lines ignored); its name is the file's stem.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from statistics import NormalDist

import numpy as np

from memo_ext.errors import UsageError

# CommonCrawl: median 300 tokens and 98% of documents within 4,096. For a log-normal the
# q-quantile is median · exp(σ · z_q), so σ = ln(4096 / 300) / z_0.98 = 2.614 / 2.054 ≈ 1.273.
COMMONCRAWL_MEDIAN_TOKENS = 300
COMMONCRAWL_P98_TOKENS = 4096
COMMONCRAWL_SIGMA = math.log(COMMONCRAWL_P98_TOKENS / COMMONCRAWL_MEDIAN_TOKENS) / (
    NormalDist().inv_cdf(0.98)
)
BUILTIN_SPECS = {
    "commoncrawl": f"lognormal(median={COMMONCRAWL_MEDIAN_TOKENS},sigma={COMMONCRAWL_SIGMA:.4f})",
    # our assumption, not fitted data (see the module docstring)
    "github": "0.9*lognormal(median=1000,sigma=1.4)+0.1*pareto(xm=8192,alpha=1.5)",
    "control": "uniform(16384,32768)",
}


class SpecError(UsageError):
    """A distribution spec or lengths file that cannot be read; the message is one sentence."""


PARAMETERS = {"lognormal": ("median", "sigma"), "pareto": ("xm", "alpha"), "uniform": ("lo", "hi")}
"""Each component's parameters, in positional order."""
_TOKEN = re.compile(
    r"\s*(?:(?P<number>\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+)|(?P<name>[a-z_]\w*)|(?P<op>[-+*(),=]))"
)
EXAMPLE_SPEC = "0.7*lognormal(median=300,sigma=1.3)+0.3*uniform(8192,32768)"


@dataclass(frozen=True)
class Component:
    """One parametric length distribution (see :data:`PARAMETERS`)."""

    kind: str
    params: tuple[float, ...]

    def sample(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """``n`` real-valued draws."""
        a, b = self.params
        if self.kind == "lognormal":
            return rng.lognormal(math.log(a), b, size=n)
        if self.kind == "pareto":
            return a * (1.0 + rng.pareto(b, size=n))  # numpy's pareto is Lomax: shift by 1
        return rng.uniform(a, b, size=n)

    def __str__(self) -> str:
        args = ",".join(f"{k}={v:g}" for k, v in zip(PARAMETERS[self.kind], self.params))
        return f"{self.kind}({args})"


@dataclass(frozen=True)
class Mixture:
    """A weighted mixture of components; ``weights`` sum to 1."""

    weights: tuple[float, ...]
    components: tuple[Component, ...]

    def sample_lengths(self, n: int, *, seed: int) -> np.ndarray:
        """``n`` document lengths in tokens (int64, at least 1), fixed by ``seed``."""
        rng = np.random.default_rng(seed)
        which = rng.choice(len(self.components), size=n, p=self.weights)
        draws = np.empty(n)
        for k, component in enumerate(self.components):
            mine = which == k
            draws[mine] = component.sample(int(mine.sum()), rng)
        return np.maximum(1, np.rint(draws)).astype(np.int64)

    def __str__(self) -> str:
        return "+".join(f"{w:.4g}*{c}" for w, c in zip(self.weights, self.components))


def _tokens(text: str, where: str) -> list[tuple[str, str]]:
    """``(kind, text)`` pairs; kind is ``number``, ``name`` or the operator itself."""
    out, pos = [], 0
    while pos < len(text.rstrip()):
        match = _TOKEN.match(text, pos)
        if not match:
            found = text[pos:].strip()[:12]
            raise SpecError(f"{where}: unexpected {found!r} (write e.g. {EXAMPLE_SPEC})")
        kind = match.lastgroup
        out.append((kind if kind != "op" else match["op"], match[kind]))
        pos = match.end()
    return out


class _Parser:
    """Recursive descent over :func:`_tokens` for the grammar in the module docstring."""

    def __init__(self, text: str, where: str) -> None:
        self.where = where
        self.tokens = _tokens(text, where)
        self.pos = 0

    def fail(self, problem: str) -> SpecError:
        return SpecError(f"{self.where}: {problem} (write e.g. {EXAMPLE_SPEC})")

    def peek(self) -> str | None:
        return self.tokens[self.pos][0] if self.pos < len(self.tokens) else None

    def take(self, kind: str, what: str) -> str:
        if self.peek() != kind:
            found = repr(self.tokens[self.pos][1]) if self.peek() else "the end"
            raise self.fail(f"expected {what}, found {found}")
        self.pos += 1
        return self.tokens[self.pos - 1][1]

    def mixture(self) -> Mixture:
        terms = [self.term()]
        while self.peek() == "+":
            self.pos += 1
            terms.append(self.term())
        if self.peek() is not None:
            raise self.fail(f"unexpected {self.tokens[self.pos][1]!r}")
        total = sum(w for w, _ in terms)
        return Mixture(tuple(w / total for w, _ in terms), tuple(c for _, c in terms))

    def term(self) -> tuple[float, Component]:
        weight = 1.0
        if self.peek() == "number":
            weight = float(self.take("number", "a weight"))
            self.take("*", "'*' after the weight")
            if weight <= 0:
                raise self.fail(f"weight {weight:g} must be positive")
        kind = self.take("name", "a component (lognormal, pareto or uniform)")
        if kind not in PARAMETERS:
            raise self.fail(f"unknown component {kind!r}, use lognormal, pareto or uniform")
        self.take("(", f"'(' after {kind}")
        args = [self.argument()]
        while self.peek() == ",":
            self.pos += 1
            args.append(self.argument())
        self.take(")", f"',' or ')' in {kind}(...)")
        return weight, _component(kind, args, self.fail)

    def argument(self) -> tuple[str | None, float]:
        name = None
        if self.peek() == "name":
            name = self.take("name", "a parameter name")
            self.take("=", f"'=' after {name}")
        sign = -1.0 if self.peek() == "-" else 1.0
        self.pos += self.peek() == "-"
        return name, sign * float(self.take("number", "a number"))


def _component(kind: str, args, fail: Callable[[str], SpecError]) -> Component:
    """Positional and named ``args`` → a checked component."""
    names = PARAMETERS[kind]
    if len(args) != len(names):
        raise fail(f"{kind} takes {len(names)} parameters ({', '.join(names)}), got {len(args)}")
    values: dict[str, float] = {}
    for position, (name, value) in enumerate(args):
        name = name or names[position]
        if name not in names:
            raise fail(f"{kind} has no parameter {name!r}, only {', '.join(names)}")
        if name in values:
            raise fail(f"{kind} gets {name} twice")
        values[name] = value
    params = tuple(values[n] for n in names)
    a, b = params
    problem = {
        "lognormal": None if a > 0 and b >= 0 else "needs median > 0 and sigma >= 0",
        "pareto": None if a > 0 and b > 0 else "needs xm > 0 and alpha > 0",
        "uniform": None if 1 <= a <= b else "needs 1 <= lo <= hi",
    }[kind]
    if problem:
        raise fail(f"{kind}({', '.join(f'{v:g}' for v in params)}) {problem}")
    return Component(kind, params)


def parse_spec(text: str, *, name: str | None = None) -> Mixture:
    """A mixture from the spec language of the module docstring (``name`` for messages).

    Raises:
        SpecError: one sentence naming the problem and showing an example.
    """
    where = f"distribution {name} = {text!r}" if name else f"distribution {text!r}"
    if not text.strip():
        raise SpecError(f"{where}: the spec is empty (write e.g. {EXAMPLE_SPEC})")
    return _Parser(text, where).mixture()


def parse_named_spec(text: str) -> tuple[str, Mixture]:
    """``NAME=SPEC`` (``--distribution``) → the name and its mixture."""
    name, sep, spec = text.partition("=")
    name = name.strip()
    if not sep or not re.fullmatch(r"[\w.-]+", name):
        raise SpecError(f"--distribution {text!r} must be NAME=SPEC, e.g. mix={EXAMPLE_SPEC}")
    return name, parse_spec(spec, name=name)


def read_lengths_file(path: str) -> np.ndarray:
    """One positive integer per line (blank lines ignored) → lengths in tokens."""
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as err:
        raise SpecError(f"--lengths-file {path}: cannot read it ({err.strerror})") from None
    lengths = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        if not line.strip().isdigit() or int(line) < 1:
            raise SpecError(
                f"--lengths-file {path}, line {number}: {line.strip()!r} is not a "
                "positive integer (give one length in tokens per line)"
            )
        lengths.append(int(line))
    if not lengths:
        raise SpecError(f"--lengths-file {path} holds no lengths")
    return np.asarray(lengths, dtype=np.int64)


def cut_to_context(lengths: np.ndarray, context: int) -> np.ndarray:
    """Documents as a pretraining loader trains them at ``context`` tokens: each longer
    document becomes ``n // context`` pieces of ``context`` tokens plus one of ``n % context``
    (when not 0). Token counts are kept; the order of pieces does not matter (batches shuffle)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    full, rest = lengths // context, lengths % context
    return np.concatenate([rest[rest > 0], np.full(int(full.sum()), context, dtype=np.int64)])


def summarize_lengths(lengths: np.ndarray) -> dict:
    """Count, mean, median, p90, p98 and the share of documents at most 4,096 tokens."""
    q50, q90, q98 = np.percentile(lengths, [50, 90, 98])
    return {
        "count": int(len(lengths)),
        "mean_tokens": float(np.mean(lengths)),
        "median_tokens": float(q50),
        "p90_tokens": float(q90),
        "p98_tokens": float(q98),
        "share_at_most_4096": float(np.mean(lengths <= 4096)),
    }


class LengthSource:
    """A document source whose documents have given lengths (their tokens do not matter)."""

    def __init__(self, lengths) -> None:
        self.lengths = [int(n) for n in lengths]

    def __len__(self) -> int:
        return len(self.lengths)

    def document(self, index: int) -> np.ndarray:
        return np.zeros(self.lengths[index], dtype=np.int64)
