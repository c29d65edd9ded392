"""Rollouts from a vLLM server (``generation.engine=vllm``): vLLM's own OpenAI-compatible server
(``vllm serve``; MooreThreads' vllm-musa on a MUSA host) samples the completions, and the policy
is pushed to it over HTTP through a folder both sides see (docs/launching.md#grpo-with-a-vllm-server).

- **Generation**: one ``POST /v1/completions`` per prompt, with the prompt as token ids, the
  sampling settings of ``generation`` and the prompt's own ``seed`` (drawn from its stream, so an
  answer depends on its seed only, not on which prompts go with it), ``return_token_ids`` and the
  model's stop tokens as ``stop_token_ids``; greedy is ``temperature=0``. Requests go in parallel
  and the server batches them (continuous batching). The fields are those of vLLM's
  ``CompletionRequest`` (vllm/entrypoints/openai/completion/protocol.py, v0.28.0).
- **Pushing a LoRA policy** (a peft model): its adapter is saved to ``generation.vllm_sync_dir``
  and loaded with ``POST /v1/load_lora_adapter`` under a name made of a fingerprint of its
  weights (``recipes-policy-<hash>``), the others unloaded (``/v1/unload_lora_adapter``). Needs
  ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=True`` and ``--enable-lora`` (docs/features/lora.md). A new
  name per change is what every vLLM with runtime LoRA accepts (``load_inplace`` is newer) and
  gives the adapter a new id, so no cached prefix of the old one is reused. Every process
  computes the name from its own copy of the policy, so requests name exactly the weights that
  generate, on every process, without a message between them: an unchanged adapter is not sent
  again, and a policy whose adapter the server lacks (not pushed since the last step or a
  resume, a restarted server) is refused, never answered by another adapter.
- **Pushing full weights** (no adapter, or an adapter that also trains whole modules, which vLLM's
  LoRA cannot hold): the (merged) model is saved as safetensors and the server reloads from that
  folder: ``POST /collective_rpc`` ``{"method": "reload_weights", "kwargs": {"weights_path":
  ...}}``, then ``POST /reset_prefix_cache``. Both are dev-mode endpoints (``VLLM_SERVER_DEV_MODE=1``;
  the worker's ``reload_weights(weights_path=...)`` as in vllm/v1/worker/gpu_model_runner.py).
  A policy whose output layer is tied to its embedding is refused: vLLM skips ``lm_head.weight``
  for such a model, and its reload left the output layer as it was (vLLM 0.32).

Checked against a real ``vllm serve`` (vLLM's CPU build 0.32.0, fp32): after a push of either
kind, greedy answers equal transformers' on the policy, token for token (tests/test_vllm_engine.py).

TRL's server mode (``trl vllm-serve``, now ``vllm serve`` with a weight-transfer backend)
broadcasts the weights in a collective from the trainer's device, which
trl/generation/vllm_client.py allows on NVIDIA's devices only, and MUSA's MCCL is not that
backend; so this module uses only HTTP and a shared folder, which any vLLM build (vllm-musa
included) serves.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import PreTrainedTokenizerBase

from recipes.adapters import is_peft_model
from recipes.config import ConfigError, GenerationConfig
from recipes.generation_rows import (
    Prompt,
    fit_prompts,
    gather_answers,
    row_stream,
    sampling_top_k,
    stop_ids,
)
from recipes.log import get_logger

if TYPE_CHECKING:
    from accelerate import Accelerator

log = get_logger(__name__)

ADAPTER_PREFIX = "recipes-policy-"  # pushed adapters are named this plus their fingerprint
_TEMPORARY: list[Path] = []  # this process's sync folder when vllm_sync_dir is null
_ASKED: set[str] = set()  # servers whose models this process asked for (said once)
# Seconds the model list may take: vLLM answers it at once (generation.vllm_timeout, 600 s by
# default, is for a whole completion); a server that accepts connections and does not answer
# it is not ready or not vLLM, and is said so within this, not after ten minutes of silence.
MODELS_TIMEOUT = 30.0
PROGRESS_EVERY = 30.0  # seconds between the lines that say how many completions are back
# What a request that timed out was waiting for, for its one line.
_WAITS_FOR = {
    "/v1/models": "the start-up check: the list of served models, answered at once by a vLLM "
    "server that is up",
    "/v1/completions": "completions: each may take up to generation.vllm_timeout",
    "/collective_rpc": "the server reloading the pushed weights",
}


@dataclass(frozen=True)
class Server:
    """Where the vLLM server is and how to talk to it (from ``generation``'s ``vllm_*``)."""

    url: str
    sync_dir: Path
    timeout: float
    concurrency: int

    @classmethod
    def of(cls, generation: GenerationConfig) -> Server:
        sync_dir = generation.vllm_sync_dir
        if sync_dir is None:
            if not _TEMPORARY:
                _TEMPORARY.append(Path(tempfile.mkdtemp(prefix="recipes-vllm-")))
            sync_dir = _TEMPORARY[0]
        return cls(
            url=generation.vllm_url.rstrip("/"),
            sync_dir=Path(sync_dir),
            timeout=float(generation.vllm_timeout),
            concurrency=generation.vllm_max_concurrent_requests,
        )

    def call(
        self, path: str, body: dict[str, Any] | None = None, timeout: float | None = None
    ) -> Any:
        """``GET`` (no body) or ``POST`` ``path``; the answer as JSON (text when it is not JSON).
        A server that does not answer (within ``timeout`` seconds, else
        ``generation.vllm_timeout``) or answers an error raises one line naming the setting and
        the fix."""
        return _parsed(self._send(path, body, timeout)[2])

    def call_json(
        self, path: str, body: dict[str, Any] | None = None, timeout: float | None = None
    ) -> dict[str, Any]:
        """:meth:`call` for an endpoint that answers a JSON object: anything else (a proxy's or
        another service's HTML page) is refused in one line with its status, content type and
        first bytes."""
        status, kind, raw = self._send(path, body, timeout)
        answer = _parsed(raw)
        if not isinstance(answer, dict):
            raise ConfigError(self._not_json(path, status, kind, raw))
        return answer

    def _send(
        self, path: str, body: dict[str, Any] | None, timeout: float | None
    ) -> tuple[int, str, str]:
        """The answer's status, content type and text."""
        request = urllib.request.Request(
            self.url + path,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="GET" if body is None else "POST",
        )
        waited = self.timeout if timeout is None else timeout
        try:
            with urllib.request.urlopen(request, timeout=waited) as response:
                raw = response.read().decode(errors="replace")
                return response.status, response.headers.get_content_type(), raw
        except urllib.error.HTTPError as err:
            raise ConfigError(
                self._refusal(path, err.code, _message(err.read().decode(errors="replace")))
            ) from None
        except (urllib.error.URLError, OSError) as err:
            reason = getattr(err, "reason", err)
            if isinstance(reason, TimeoutError):  # it accepted the connection, then said nothing
                raise ConfigError(
                    f"generation.vllm_url={self.url}: {path} got no answer within {waited:g} s "
                    f"({_WAITS_FOR.get(path, 'its answer')}); see the server's log (is it still "
                    "loading, stuck, or not vLLM?), or raise generation.vllm_timeout for a slow "
                    "one"
                ) from None
            raise ConfigError(
                f"generation.vllm_url={self.url}: no vLLM server answers ({reason}); start one "
                "(`vllm serve <model folder>`, docs/launching.md#grpo-with-a-vllm-server) or set "
                "generation.vllm_url to where it listens"
            ) from None

    def _not_json(self, path: str, status: int, kind: str, raw: str) -> str:
        return (
            f"generation.vllm_url={self.url}: {path} answered {status} with {kind}, not the "
            f"JSON vLLM answers ({raw.strip()[:80]!r}); point generation.vllm_url at the vLLM "
            "server itself (`vllm serve`), not a proxy's or another service's page"
        )

    def _refusal(self, path: str, status: int, message: str) -> str:
        said = f"generation.vllm_url={self.url}: {path} answered {status} ({message})"
        if path.endswith("lora_adapter") and status in (404, 405):
            return (
                f"{said}: runtime LoRA loading is off; start the server with "
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True and --enable-lora --max-lora-rank <peft.r>"
            )
        if path.endswith("lora_adapter"):
            return (
                f"{said}: the server must see generation.vllm_sync_dir={self.sync_dir} under the "
                "same path, and have --enable-lora with --max-lora-rank at least peft.r"
            )
        if path in ("/collective_rpc", "/reset_prefix_cache") and status in (404, 405):
            return (
                f"{said}: full-weight pushes use vLLM's dev-mode endpoints; start the server "
                "with VLLM_SERVER_DEV_MODE=1 (or train with peft=lora, pushed as an adapter)"
            )
        if path == "/collective_rpc":
            return (
                f"{said}: the server must see generation.vllm_sync_dir={self.sync_dir} under the "
                "same path, and serve the architecture the policy has"
            )
        return f"{said}: check that it serves the policy's base model (model.name_or_path)"

    def models(self) -> tuple[str, list[str]]:
        """The served base model's name and the names of the adapters pushed to it; asked
        within :data:`MODELS_TIMEOUT` (a vLLM server lists them at once, even while it
        generates), the start-up check of a server that is not there or not vLLM."""
        if self.url not in _ASKED:
            log.info(
                "asking the vLLM server at %s for its models (/v1/models, at most %g s)",
                self.url,
                min(self.timeout, MODELS_TIMEOUT),
            )
            _ASKED.add(self.url)
        listed = self.call_json("/v1/models", timeout=min(self.timeout, MODELS_TIMEOUT))
        cards = listed.get("data") or []
        if not cards:
            raise ConfigError(
                f"generation.vllm_url={self.url}: /v1/models lists no model; serve the "
                "policy's base model there"
            )
        base = next((c["id"] for c in cards if not c.get("parent")), cards[0]["id"])
        return base, [c["id"] for c in cards if c["id"].startswith(ADAPTER_PREFIX)]


def _adapter_name(model: torch.nn.Module) -> str | None:
    """The name the policy's LoRA adapter is pushed under: a fingerprint of its weights, which
    every process of a run computes alike (DDP keeps them equal); None for a fresh adapter
    (every ``lora_B`` zero: the base model itself)."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(
        model, adapter_name=model.active_adapter, save_embedding_layers=False
    )
    if all(not t.any() for name, t in state.items() if "lora_B" in name):
        return None
    digest = hashlib.blake2b(digest_size=8)
    for name, tensor in sorted(state.items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return ADAPTER_PREFIX + digest.hexdigest()


def _served_name(model: torch.nn.Module, server: Server) -> str:
    """The model name the requests give: the policy's adapter, where it is pushed as one, else
    the served model (the base, or the full weights pushed last). A policy whose adapter the
    server does not hold is refused rather than answered by another one (an earlier step's, a
    previous run's)."""
    base, adapters = server.models()
    if not (is_peft_model(model) and not _trained_in_full(model)):
        return base
    name = _adapter_name(model)
    if name is None:
        return base
    if name not in adapters:
        raise ConfigError(
            f"generation.engine=vllm: the server at generation.vllm_url={server.url} does not "
            f"hold the policy's LoRA adapter ({name}): push_weights must send it before the "
            "policy generates (after each optimizer step, after a resume, and again if the "
            "server restarted)"
        )
    return name


def _message(body: str) -> str:
    """The server's error text: vLLM answers ``{"error": {"message": ...}}`` (older releases
    ``{"message": ...}``, FastAPI ``{"detail": ...}``)."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return body.strip()[:300] or "no message"
    if isinstance(data, dict):
        error = data.get("error")
        text = error.get("message") if isinstance(error, dict) else None
        return str(text or data.get("message") or data.get("detail") or data)[:300]
    return str(data)[:300]


def complete_ids(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    tokenizer: PreTrainedTokenizerBase,
    generation: GenerationConfig,
    max_new_tokens: int | Sequence[int],
    *,
    max_length: int | None = None,
    accelerator: Accelerator | None = None,
    seed: int | None = None,
    streams: Sequence[torch.Generator] | None = None,
) -> list[list[int]]:
    """The new token ids of each prompt, from the vLLM server, as
    :func:`recipes.generation.complete_ids` gives them (same arguments): in the prompts' order,
    up to and with the first stop token; a prompt longer than ``max_length`` keeps its end.
    A LoRA policy generates with its own adapter as :func:`push_weights` sent it (refused
    when the server lacks it), any other with the server's model (the full weights pushed
    last, or the model it was started with)."""
    unwrapped = accelerator.unwrap_model(model) if accelerator else model
    server = Server.of(generation)
    beams = generation.num_beams or getattr(unwrapped.generation_config, "num_beams", 1) or 1
    if beams > 1:
        raise ConfigError(
            f"generation.num_beams={beams}: the vLLM engine samples or decodes greedily, without "
            "beam search; set generation.num_beams=1, or generation.engine=batched for beams"
        )
    name = _served_name(unwrapped, server)
    stops = _stop_ids(unwrapped, tokenizer)
    sampling = _sampling(unwrapped, generation)
    base_seed = torch.initial_seed() if seed is None else seed
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
    rows = fit_prompts(prompts, max_new_tokens, max_length)
    mine = rows[rank::world]

    # Each prompt's seed is drawn from its own stream (row i's: seed + i), here, in order.
    seeds = {
        row.index: int(torch.randint(0, 2**31 - 1, (1,), generator=stream))
        for row in mine
        for stream in [streams[row.index] if streams else row_stream(base_seed, row.index)]
        if generation.do_sample
    }

    def send(row: Prompt) -> tuple[int, list[int]]:
        body = {"model": name, "prompt": row.ids, "max_tokens": row.max_new_tokens, "n": 1}
        body |= {**sampling, "stop_token_ids": stops, "return_token_ids": True}
        if generation.do_sample:
            body["seed"] = seeds[row.index]
        answer = server.call_json("/v1/completions", body)
        choices = answer.get("choices")
        if not (isinstance(choices, list) and choices and isinstance(choices[0], dict)):
            raise ConfigError(
                f"generation.vllm_url={server.url}: /v1/completions answered without choices "
                f"({json.dumps(answer)[:80]!r}); point generation.vllm_url at a vLLM server"
            )
        choice = choices[0]
        if choice.get("token_ids") is None:
            raise ConfigError(
                f"generation.vllm_url={server.url}: /v1/completions returned no token_ids; "
                "serve with a vLLM whose completions take return_token_ids (0.28, vllm-musa's "
                "base, does)"
            )
        new = list(choice["token_ids"])[: row.max_new_tokens]
        end = next((k + 1 for k, token in enumerate(new) if token in stops), len(new))
        return row.index, new[:end]

    done: list[tuple[int, list[int]]] = []
    if mine:
        with ThreadPoolExecutor(max_workers=min(server.concurrency, len(mine))) as pool:
            done = _waited([pool.submit(send, row) for row in mine], "completions", server)
    return gather_answers(done, rows, accelerator)


def _waited(futures: list[Future], what: str, server: Server) -> list[Any]:
    """The results of ``futures`` in order (the first failure raised at once); while they are
    not all back, every :data:`PROGRESS_EVERY` seconds a line says how many are."""
    start, pending = time.monotonic(), set(futures)
    while pending:
        done, pending = wait(pending, timeout=PROGRESS_EVERY, return_when=FIRST_EXCEPTION)
        for future in done:
            future.result()  # raises the request's one line
        if pending:
            log.info(
                "waiting for %s from the vLLM server at %s: %d of %d back after %.0f s "
                "(generation.vllm_timeout=%g s a request)",
                what,
                server.url,
                len(futures) - len(pending),
                len(futures),
                time.monotonic() - start,
                server.timeout,
            )
    return [future.result() for future in futures]


def _parsed(raw: str) -> Any:
    """An answer's JSON, or its text when it is none (an empty answer: None)."""
    try:
        return json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return raw


def _stop_ids(model: torch.nn.Module, tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """The model's stop tokens (its generation_config's ``eos_token_id``, which holds the chat
    template's end of turn) and the tokenizer's EOS, where vLLM stops by default."""
    ids = stop_ids(model)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def _sampling(model: torch.nn.Module, generation: GenerationConfig) -> dict[str, Any]:
    """vLLM's sampling fields for ``generation``, every one set (the server would otherwise
    take the defaults of its model's generation_config): greedy is temperature 0; top_k unset
    is the model's own (50 when it has none), as transformers samples (recipes.generation)."""
    if not generation.do_sample:
        return {"temperature": 0.0}
    return {
        "temperature": generation.temperature,
        "top_p": generation.top_p,
        "top_k": sampling_top_k(model, generation),  # 0: every token, in vLLM as in transformers
    }


def push_weights(
    model: torch.nn.Module, generation: GenerationConfig, accelerator: Accelerator | None
) -> None:
    """Send the policy to the server: its LoRA adapter when ``model`` is a peft model whose
    adapter vLLM can hold (nothing when the server has it already), otherwise the (merged)
    weights. Call on the main process after each optimizer step and before the policy
    generates, and let the other processes wait for it."""
    unwrapped = accelerator.unwrap_model(model) if accelerator else model
    server = Server.of(generation)
    server.sync_dir.mkdir(parents=True, exist_ok=True)
    if is_peft_model(unwrapped) and not _trained_in_full(unwrapped):
        _push_adapter(unwrapped, server)
        return
    base = unwrapped.get_base_model() if is_peft_model(unwrapped) else unwrapped
    if getattr(base.config, "tie_word_embeddings", False):
        # vLLM ties its output layer to the embedding and skips lm_head.weight when loading;
        # reload_weights then leaves the output layer as it was (seen with vLLM 0.32: the
        # answers after a push of moved embeddings were not the policy's).
        raise ConfigError(
            "generation.engine=vllm: the policy's output layer is tied to its input embedding "
            "(tie_word_embeddings), which vLLM's reload_weights does not update; train with "
            "peft=lora (pushed as an adapter, without peft.modules_to_save), or "
            "generation.engine=batched"
        )
    _push_full(unwrapped, server)


def _trained_in_full(model: torch.nn.Module) -> list[str]:
    return list(model.peft_config[model.active_adapter].modules_to_save or [])


def _push_adapter(model: torch.nn.Module, server: Server) -> None:
    _, adapters = server.models()
    name = _adapter_name(model)
    if name is not None and name not in adapters:  # unchanged since the last push: nothing
        folder = server.sync_dir / name
        model.save_pretrained(folder, save_embedding_layers=False)
        server.call("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(folder)})
    for old in (a for a in adapters if a != name):
        server.call("/v1/unload_lora_adapter", {"lora_name": old})
        shutil.rmtree(server.sync_dir / old, ignore_errors=True)  # ours only: the sync folder's
    log.debug("pushed the LoRA adapter to %s as %s", server.url, name)


def _push_full(model: torch.nn.Module, server: Server) -> None:
    folder = server.sync_dir / "weights"
    if is_peft_model(model):
        # vLLM's LoRA has no whole modules (modules_to_save): the merged model goes, made on a
        # copy as the run's final/ is (recipes.adapters.save_final).
        log.info(
            "pushing merged weights to vLLM: the adapter also trains %s in full",
            ", ".join(_trained_in_full(model)),
        )
        copy.deepcopy(model).merge_and_unload().save_pretrained(folder)
    else:
        model.save_pretrained(folder)
    with ThreadPoolExecutor(max_workers=1) as pool:  # a reload can take long: said while it runs
        reload = {"method": "reload_weights", "kwargs": {"weights_path": str(folder)}}
        _waited([pool.submit(server.call, "/collective_rpc", reload)], "the weight reload", server)
    answer = server.call("/reset_prefix_cache", {})  # cached prefixes hold the old weights'
    for old in server.models()[1]:  # an adapter pushed before would still be asked for
        server.call("/v1/unload_lora_adapter", {"lora_name": old})
        shutil.rmtree(server.sync_dir / old, ignore_errors=True)
    if isinstance(answer, dict) and answer.get("success") is False:
        log.warning("vLLM kept its prefix cache after the weight push (requests were running)")
    log.debug("pushed the weights to %s", server.url)
