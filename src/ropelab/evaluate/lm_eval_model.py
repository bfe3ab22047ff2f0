"""The lm-evaluation-harness model "ropelab": a ropelab run, checkpoint or imported folder scored and
generated from as the harness asks (`ropelab.evaluate.lm_eval` says how the harness finds it).

  RopelabLM                    ``--model ropelab --model_args pretrained=RUN_OR_CHECKPOINT[,batch_size=8,
                               device=cuda,max_length=N,...]`` (model_args: `ropelab.evaluate.lm_eval_args`)
  effective_rope_fraction(c)   rotated channels over head channels, averaged over layers

Importing this module registers "ropelab" in the harness's registry.

Scoring follows the harness's HF backend (``HFLM``): the same context/continuation split, left
truncation to ``max_length`` and rolling windows. Two defaults are ropelab's own: ``max_length`` is the
context the weights were trained at (`ropelab.evaluate.trained_context.trained_length`: a trained run's
``data.seq_len``, not its 8192+ ``model.max_seq_len``; a released checkpoint's own context), and the
prefix token of empty contexts and rolling windows is EOS (what ropelab training puts between
documents, whatever BOS the tokenizer has). ``ropelab export`` writes both where HFLM reads them (see
`ropelab.export.hf`), so ``--model hf`` on an exported folder gives the same number for every item as
``--model ropelab`` on its run, with no model_args beyond ``dtype=float32``.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable, Optional, Sequence

import torch
import torch.nn.functional as F
from tqdm import tqdm

from ropelab import sources
from ropelab.config import ConfigError
from ropelab.evaluate.lm_eval_args import parse_batch_size, parse_dtype, parse_int
from ropelab.evaluate.trained_context import trained_length

try:
    import lm_eval.models  # noqa: F401 - fills the registry with the built-in models (get_model only
    # imports them into an *empty* registry, and registering "ropelab" first would hide "hf" & co.)
    from lm_eval.api.model import TemplateLM
    from lm_eval.api.registry import register_model
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError(
        f"ropelab.evaluate.lm_eval needs lm-evaluation-harness ({exc}): pip install 'ropelab[eval]'"
    ) from exc

log = logging.getLogger(__name__)


def effective_rope_fraction(config) -> float:
    """Rotated channels over head channels, averaged over layers (per-layer overrides included)."""
    c = config.model if hasattr(config, "model") else config
    dims = [c.rope_for_layer(layer).resolve_dims(c.head_size) for layer in range(c.n_layer)]
    return sum(dims) / (len(dims) * c.head_size)


class RopelabLM(TemplateLM):
    """A ropelab run, checkpoint or imported folder as an lm-eval model (fp32 on CUDA when present).

    model_args: pretrained (required), batch_size (8), device (cuda if available, else cpu),
    max_length (`trained_length`: a run's data.seq_len, a released model's context), max_gen_toks
    (256), prefix_token_id (EOS), dtype (float32 | bfloat16 | float16 | auto). Generation is greedy;
    ``until`` strings and EOS stop it."""

    def __init__(
        self,
        pretrained: str,
        batch_size: Any = 8,
        max_batch_size: Any = None,  # passed by the harness; no automatic sizing here
        device: Optional[str] = None,
        max_length: Any = None,
        max_gen_toks: Any = 256,
        prefix_token_id: Any = None,
        dtype: str = "float32",
        **kwargs: Any,
    ) -> None:
        super().__init__()
        if kwargs:
            log.warning("ropelab: ignoring unknown model_args %s", ", ".join(sorted(kwargs)))
        self.pretrained = str(pretrained)
        source = sources.resolve(self.pretrained)
        model, self.rope_tokenizer, config = sources.load(source)
        self.checkpoint = str(source.checkpoint or source.location)
        data = config.data
        if self.rope_tokenizer.vocab_size > config.model.vocab_size:
            raise ConfigError(
                f"{pretrained}: tokenizer {data.tokenizer!r} has {self.rope_tokenizer.vocab_size} tokens, "
                f"the model {config.model.vocab_size}; not the run's tokenizer"
            )
        if device and str(device).startswith("cuda") and not torch.cuda.is_available():
            log.warning("ropelab: device=%s but CUDA is not available; using the CPU", device)  # HFLM does the same
            device = "cpu"
        self._device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.dtype = parse_dtype(str(dtype), self._device)
        self.model = model.to(self._device, self.dtype).eval()
        self.run_config = config
        self._batch_size = parse_batch_size(batch_size)
        self._max_length = parse_int(max_length, "max_length") or trained_length(source, config)
        self._max_gen_toks = parse_int(max_gen_toks, "max_gen_toks") or 256
        self._prefix = parse_int(prefix_token_id, "prefix_token_id")
        self.rope_fraction = effective_rope_fraction(config)
        self._warned_sampling = False

    # ---------------------------------------------------------------- harness properties

    @property
    def eot_token_id(self) -> int:
        return self.rope_tokenizer.eos_id

    @property
    def prefix_token_id(self) -> int:
        return self.eot_token_id if self._prefix is None else self._prefix

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def batch_size(self) -> int:
        return self._batch_size

    @property
    def device(self) -> torch.device:
        return self._device

    @property
    def tokenizer_name(self) -> str:
        return f"ropelab:{self.run_config.data.tokenizer}"

    def get_model_info(self) -> dict:
        return {
            "ropelab_checkpoint": self.checkpoint,
            "model_num_parameters": self.model.num_params(),
            "effective_rope_fraction": self.rope_fraction,
            "max_length": self.max_length,
            "dtype": str(self.dtype).removeprefix("torch."),
        }

    def tok_encode(self, string: str, add_special_tokens: Optional[bool] = None, **kwargs: Any) -> list[int]:
        return self.rope_tokenizer.encode_batch([string])[0]  # ropelab tokenizers add no special tokens

    def tok_decode(self, tokens: Iterable[int], **kwargs: Any) -> str:
        return self.rope_tokenizer.decode([int(t) for t in tokens])

    # ---------------------------------------------------------------- scoring

    @torch.no_grad()
    def _score(self, pairs: Sequence[tuple[list[int], list[int]]], disable_tqdm: bool = True) -> list[tuple[float, bool]]:
        """(sum of continuation log-probs, continuation is the greedy one) per (context, continuation),
        the input left-truncated to max_length tokens as HFLM does."""
        results: list[Optional[tuple[float, bool]]] = [None] * len(pairs)
        inputs = []
        for context, continuation in pairs:
            if not continuation:
                raise ValueError("ropelab: empty continuation")
            if not context:  # the harness moves a context's trailing whitespace into the continuation
                raise ValueError("ropelab: empty context (a context of only whitespace?); HFLM refuses it too")
            if len(continuation) > self.max_length:
                raise ValueError(f"ropelab: continuation of {len(continuation)} tokens > max_length {self.max_length}")
            inputs.append((context + continuation)[-(self.max_length + 1):][:-1])
        order = sorted(range(len(pairs)), key=lambda i: -len(inputs[i]))
        pad = self.eot_token_id
        progress = tqdm(total=len(pairs), disable=disable_tqdm or len(pairs) < 2, desc="ropelab: scoring")
        for start in range(0, len(order), self.batch_size):
            chunk = order[start:start + self.batch_size]
            width = len(inputs[chunk[0]])
            batch = torch.full((len(chunk), width), pad, dtype=torch.long)
            for row, i in enumerate(chunk):
                batch[row, : len(inputs[i])] = torch.tensor(inputs[i], dtype=torch.long)
            hidden = self.model.hidden_states(batch.to(self.device))  # right padding: causal, never attended
            for row, i in enumerate(chunk):
                n, target = len(inputs[i]), pairs[i][1]
                logits = self.model.lm_head(hidden[row, n - len(target): n]).float()  # (len(target), V)
                logprobs = F.log_softmax(logits, dim=-1)
                target_t = torch.tensor(target, dtype=torch.long, device=logprobs.device)
                score = logprobs.gather(-1, target_t[:, None]).sum().item()
                results[i] = (float(score), bool((logprobs.argmax(-1) == target_t).all()))
            progress.update(len(chunk))
        progress.close()
        return results  # type: ignore[return-value]

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs: Any) -> list[tuple[float, bool]]:
        results = self._score([(context, continuation) for _, context, continuation in requests], disable_tqdm)
        for (request, _, _), answer in zip(requests, results):
            if request is not None:
                self.cache_hook.add_partial("loglikelihood", request, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows, owners = [], []
        for index, request in enumerate(requests):
            (string,) = request.args
            for window in get_rolling_token_windows(
                token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1,
            ):
                windows.append(make_disjoint_window(window))
                owners.append(index)
        totals = [0.0] * len(requests)
        for owner, (score, _) in zip(owners, self._score(windows, disable_tqdm)):
            totals[owner] += score
        for request, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals

    # ---------------------------------------------------------------- generation

    @torch.no_grad()
    def _greedy(self, contexts: list[list[int]], until: list[str], max_new: int) -> list[str]:
        """Greedy continuation of each context (right-padded batch, no KV cache), stopped by EOS,
        by any of `until` in the decoded text, or after max_new tokens; the text before the first stop."""
        eos = self.eot_token_id
        generated: list[list[int]] = [[] for _ in contexts]
        done = [False] * len(contexts)
        for _ in range(max_new):
            live = [i for i, d in enumerate(done) if not d]
            if not live:
                break
            seqs = [contexts[i] + generated[i] for i in live]
            width = max(len(s) for s in seqs)
            batch = torch.full((len(live), width), eos, dtype=torch.long)
            for row, seq in enumerate(seqs):
                batch[row, : len(seq)] = torch.tensor(seq, dtype=torch.long)
            hidden = self.model.hidden_states(batch.to(self.device))
            last = torch.stack([hidden[row, len(seq) - 1] for row, seq in enumerate(seqs)])
            next_ids = self.model.lm_head(last).float().argmax(-1).tolist()
            for i, token in zip(live, next_ids):
                if token == eos:
                    done[i] = True
                    continue
                generated[i].append(int(token))
                if until and any(stop in self.tok_decode(generated[i]) for stop in until):
                    done[i] = True
        texts = []
        for ids in generated:
            text = self.tok_decode(ids)
            for stop in until:
                if stop:
                    text = text.split(stop)[0]
            texts.append(text)
        return texts

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        groups: dict[tuple, list[int]] = {}
        settings = []
        for index, request in enumerate(requests):
            context, gen_kwargs = request.args
            gen_kwargs = dict(gen_kwargs or {})
            until = gen_kwargs.pop("until", None) or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = parse_int(
                gen_kwargs.pop("max_gen_toks", None) or gen_kwargs.pop("max_new_tokens", None), "max_gen_toks"
            ) or self.max_gen_toks
            if (gen_kwargs.get("do_sample") or float(gen_kwargs.get("temperature", 0) or 0) > 0) and not self._warned_sampling:
                log.warning("ropelab: sampling requested (%s); generating greedily", gen_kwargs)
                self._warned_sampling = True
            settings.append((context, until, max_new))
            groups.setdefault((tuple(until), max_new), []).append(index)
        out: list[Optional[str]] = [None] * len(requests)
        for (until, max_new), indices in groups.items():
            budget = self.max_length - max_new
            if budget <= 0:
                raise ConfigError(f"max_gen_toks={max_new} leaves no room for a context in max_length={self.max_length}")
            for start in range(0, len(indices), self.batch_size):
                chunk = indices[start:start + self.batch_size]
                contexts = [(self.tok_encode(settings[i][0]) or [self.prefix_token_id])[-budget:] for i in chunk]
                for i, text in zip(chunk, self._greedy(contexts, list(until), max_new)):
                    out[i] = text
                    self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return out  # type: ignore[return-value]


def _register() -> None:
    try:
        register_model("ropelab")(RopelabLM)
    except ValueError:  # already there as an entry-point placeholder for this very class
        pass


_register()


__all__ = ["RopelabLM", "effective_rope_fraction"]
