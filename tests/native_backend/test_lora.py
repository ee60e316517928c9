"""LoRA adapters (issue 43) against peft's PeftModel: adapters made by peft itself
(LoraConfig(init_lora_weights=False): a random, non-zero B) on the tiny test Llama; every logits
row of a chunked prefill and of decodes matches PeftModel's forward, and a batch mixing three
adapters and base rows gives each row the greedy tokens of its solo PeftModel run."""

from __future__ import annotations

import copy
import json
import os
import shutil

import peft
import pytest
import torch
from safetensors.torch import load_file, save_file

from native_backend.config.engine import EngineConfig
from native_backend.core.batch import ScheduledChunk, SchedulerOutput
from native_backend.core.engine import LLMEngine
from native_backend.core.interface import EngineError, EngineRequest
from native_backend.core.sampling_params import SamplingParams
from native_backend.execution.executor import InProcessExecutor
from native_backend.execution.model_runner import ModelRunner
from native_backend.model.lora import LoRAError, LoRAManager, LoRAOptions
from native_backend.model.kv_cache import KVCache
from tests.native_backend.test_models_llama import Blocks, rand_tokens
from tests.support.data.llama_checkpoints import make_checkpoint

torch.set_num_threads(2)
ATOL = 1e-4
BLOCK_SIZE = 4
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (LoraConfig settings, seed): every target module, a subset with rslora, the MLP alone
ADAPTERS = {
    "all": (dict(r=4, lora_alpha=8, target_modules=ALL), 1),
    "qv-rslora": (dict(r=8, lora_alpha=4, target_modules=["q_proj", "v_proj"], use_rslora=True), 2),
    "mlp": (dict(r=2, lora_alpha=16, target_modules=["gate_proj", "up_proj", "down_proj"]), 3),
}


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """(hf base, our model, {name: (adapter dir, PeftModel)})."""
    root = tmp_path_factory.mktemp("lora")
    hf, ours = make_checkpoint(root / "base", tie=False, rope_scaling=None)
    adapters = {}
    for name, (settings, seed) in ADAPTERS.items():
        torch.manual_seed(seed)
        config = peft.LoraConfig(init_lora_weights=False, lora_dropout=0.0, **settings)
        model = peft.get_peft_model(copy.deepcopy(hf), config).eval()
        model.save_pretrained(root / name)
        adapters[name] = (str(root / name), model)
    return hf, ours, adapters


def make_runner(ours, adapters, max_loras=3):
    lora = LoRAManager(ours, LoRAOptions(enable_lora=True, max_loras=max_loras, max_lora_rank=8, max_cpu_loras=4))
    for name, (path, _) in adapters.items():
        lora.add(name, path)
    cache = KVCache.for_model(ours.config, num_blocks=96, block_size=BLOCK_SIZE)
    return ModelRunner(ours, cache, lora=lora), lora


@pytest.fixture
def runner(setup):
    _, ours, adapters = setup
    runner, lora = make_runner(ours, adapters)
    yield runner
    for hook in lora._hooks:
        hook.remove()


def chunk(rid, tokens, start, table, lora_name):
    return ScheduledChunk(rid, list(tokens), start, list(table), True, SamplingParams(temperature=0.0),
                          lora_name=lora_name)


def ref_logits(model, tokens):
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def test_chunked_prefill_and_decodes_match_peft_per_adapter_in_one_batch(setup, runner):
    """Rows of three adapters and one base row share every step: chunked prefills, then decodes."""
    hf, _, adapters = setup
    refs = {name: model for name, (_, model) in adapters.items()} | {None: hf}
    seqs = {name: rand_tokens(13, seed=20 + i) for i, name in enumerate(refs)}
    blocks, tables = Blocks(96), {name: [] for name in refs}
    for span in [(0, 5), (5, 9), (9, 10), (10, 11), (11, 13)]:
        chunks = [chunk(str(name), seqs[name][slice(*span)], span[0], blocks.table_for(tables[name], span[1]), name)
                  for name in refs]
        logits = runner.compute_logits(SchedulerOutput(chunks), all_tokens=True)
        for name, model in refs.items():
            expected = ref_logits(model, seqs[name])[slice(*span)]
            torch.testing.assert_close(logits[str(name)], expected, atol=ATOL, rtol=0, msg=f"adapter {name}")
    # the adapters do change the model: each row is far from the base's
    for name in adapters:
        assert (ref_logits(refs[name], seqs[name]) - ref_logits(hf, seqs[name])).abs().max() > 0.1


def greedy(model, prompt, n):
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(ref_logits(model, tokens)[-1].argmax()))
    return tokens[len(prompt):]


def test_mixed_batch_greedy_tokens_equal_each_rows_solo_peft_run(setup, runner):
    hf, _, adapters = setup
    rows = {"a": "all", "b": "qv-rslora", "c": None, "d": "mlp", "e": "all", "f": None}
    prompts = {rid: rand_tokens(6 + i, seed=40 + i) for i, rid in enumerate(rows)}
    models = {rid: adapters[name][1] if name else hf for rid, name in rows.items()}
    expected = {rid: greedy(models[rid], prompts[rid], 6) for rid in rows}
    assert len({tuple(v) for v in expected.values()}) > 2  # the adapters make different texts
    blocks, tables = Blocks(96), {rid: [] for rid in rows}
    history = {rid: list(p) for rid, p in prompts.items()}
    starts = {rid: 0 for rid in rows}
    for _ in range(6):
        chunks = [chunk(rid, history[rid][starts[rid]:], starts[rid], blocks.table_for(tables[rid], len(history[rid])),
                        rows[rid]) for rid in rows]
        out = runner.execute(SchedulerOutput(chunks))
        for rid in rows:
            starts[rid] = len(history[rid])
            history[rid] += out.sampled_token_ids[rid]
    assert {rid: history[rid][len(prompts[rid]):] for rid in rows} == expected


def broken_copy(src, dst, *, config=None, tensors=None):
    shutil.copytree(src, dst)
    if config:
        path = os.path.join(dst, "adapter_config.json")
        data = json.load(open(path))
        data.update(config)
        json.dump(data, open(path, "w"))
    if tensors:
        path = os.path.join(dst, "adapter_model.safetensors")
        save_file(tensors(load_file(path)), path)
    return str(dst)


def _reshape_one(ts):
    key = next(k for k in ts if k.endswith("q_proj.lora_A.weight"))
    return ts | {key: torch.zeros(ts[key].shape[0], 7)}


def _rename_one(ts):
    key = next(k for k in ts if "q_proj" in k)
    return {(key.replace("q_proj", "qkv_proj") if k == key else k): v for k, v in ts.items()}


def _nan_one(ts):
    key = next(iter(ts))
    ts[key][0, 0] = float("nan")
    return ts


BROKEN = {
    "missing file": (dict(tensors=lambda ts: ts), "no adapter_model.safetensors"),
    "wrong shape": (dict(tensors=_reshape_one), "do not fit the base linear"),
    "unknown module": (dict(tensors=_rename_one), "unknown target module self_attn.qkv_proj"),
    "non-finite": (dict(tensors=_nan_one), "non-finite weights"),
    "modules_to_save": (dict(config={"modules_to_save": ["lm_head"]}), "modules_to_save"),
    "dora": (dict(config={"use_dora": True}), "use_dora"),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_bad_adapters_are_refused_by_name_and_the_engine_keeps_serving(setup, runner, tmp_path, case):
    hf, _, adapters = setup
    how, message = BROKEN[case]
    path = broken_copy(adapters["all"][0], tmp_path / "bad", **how)
    if case == "missing file":
        os.remove(os.path.join(path, "adapter_model.safetensors"))
    with pytest.raises(LoRAError, match=message) as err:
        runner.lora.add("bad", path)
    assert "'bad'" in str(err.value) and "bad" not in runner.lora.adapters
    seq = rand_tokens(7, seed=60)
    logits = runner.compute_logits(SchedulerOutput([chunk("x", seq, 0, Blocks(96).table_for([], 7), "mlp")]))
    torch.testing.assert_close(logits["x"][0], ref_logits(adapters["mlp"][1], seq)[-1], atol=ATOL, rtol=0)


def test_rank_over_max_lora_rank_is_refused(setup, runner):
    _, ours, adapters = setup
    small = LoRAManager(ours, LoRAOptions(enable_lora=True, max_lora_rank=4))
    try:
        with pytest.raises(LoRAError, match="rank 8 is over max_lora_rank 4"):
            small.add("qv", adapters["qv-rslora"][0])
    finally:
        for hook in small._hooks:
            hook.remove()


def test_more_adapters_than_slots_in_one_step_is_refused_and_slots_are_reused(setup):
    _, ours, adapters = setup
    runner, lora = make_runner(ours, adapters, max_loras=1)
    try:
        assert lora.can_schedule("all", set()) and not lora.can_schedule("mlp", {"all"})
        table = Blocks(96).table_for([], 4)
        with pytest.raises(ValueError, match="max_loras is 1"):
            runner.compute_logits(SchedulerOutput([chunk("a", [1, 2], 0, table, "all"),
                                                   chunk("b", [3, 4], 0, table, "mlp")]))
        for name in ("all", "mlp"):  # one slot, two adapters in turn
            runner.compute_logits(SchedulerOutput([chunk("a", [1, 2], 0, table, name)]))
            assert lora.slots == [name]
    finally:
        for hook in lora._hooks:
            hook.remove()


def test_engine_serves_adapters_by_name_with_their_peft_tokens(setup, tmp_path):
    """The whole engine: static lora_modules plus one added at run time, max_loras=2 slots for
    three adapters and base rows (one adapter's requests wait for a slot), greedy tokens equal
    each request's solo PeftModel run; an unknown or broken adapter is refused, serving goes on."""
    hf, _, adapters = setup
    base = os.path.join(os.path.dirname(adapters["all"][0]), "base")
    config = EngineConfig.build(path=base, kv_cache_bytes=2 << 20, block_size=4, max_num_batched_tokens=16,
                                enable_lora=True, max_loras=2, max_lora_rank=8, max_cpu_loras=3,
                                lora_modules={"all": adapters["all"][0], "mlp": adapters["mlp"][0]})
    executor = InProcessExecutor(config)
    engine = LLMEngine(config, executor)
    try:
        engine.add_lora("qv-rslora", adapters["qv-rslora"][0])
        with pytest.raises(EngineError, match="'nope' is not loaded"):
            engine.add_request(EngineRequest("x", [1, 2, 3], GREEDY, lora_name="nope"))
        broken = broken_copy(adapters["all"][0], tmp_path / "bad", config={"modules_to_save": ["lm_head"]})
        with pytest.raises(EngineError, match="'bad': modules_to_save"):
            engine.add_lora("bad", broken)
        rows = {"a": "all", "b": "mlp", "c": None, "d": "qv-rslora", "e": "all"}
        prompt = rand_tokens(9, seed=70)  # one prompt for all: cached blocks must not cross adapters
        for rid, name in rows.items():
            engine.add_request(EngineRequest(rid, prompt, GREEDY, lora_name=name))
        got = {rid: [] for rid in rows}
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id] += out.new_token_ids
        models = {rid: adapters[name][1] if name else hf for rid, name in rows.items()}
        assert got == {rid: greedy(models[rid], prompt, GREEDY.max_tokens) for rid in rows}
    finally:
        executor.close()
        for hook in executor.lora._hooks:
            hook.remove()


def test_adapters_dropped_from_ram_are_read_again_and_unloading_waits_for_their_requests(setup):
    """max_cpu_loras=1 for two served adapters: a request for the one dropped from RAM reads it
    again and gets its PeftModel tokens; an adapter unfinished requests use cannot be unloaded,
    one no request uses can, and is then refused; stats say which adapters run and wait."""
    hf, _, adapters = setup
    base = os.path.join(os.path.dirname(adapters["all"][0]), "base")
    config = EngineConfig.build(path=base, kv_cache_bytes=2 << 20, block_size=4, max_num_batched_tokens=16,
                                enable_lora=True, max_loras=1, max_lora_rank=8, max_cpu_loras=1,
                                lora_modules={"all": adapters["all"][0], "mlp": adapters["mlp"][0]})
    executor = InProcessExecutor(config)
    engine = LLMEngine(config, executor)
    try:
        assert list(executor.lora.adapters) == ["mlp"]  # "all" was dropped to keep one in RAM
        prompt = rand_tokens(9, seed=71)
        engine.add_request(EngineRequest("a", prompt, GREEDY, lora_name="all"))
        engine.add_request(EngineRequest("m", prompt, GREEDY, lora_name="mlp"))
        first = engine.step()
        lora = engine.stats().lora
        assert (lora.max_loras, lora.running, lora.waiting) == (1, ("all",), ("mlp",))
        assert lora.adapters == {"all": adapters["all"][0], "mlp": adapters["mlp"][0]}
        with pytest.raises(EngineError, match="'mlp' is in use"):
            engine.remove_lora("mlp")
        got = {"a": [], "m": []}
        for out in first:
            got[out.request_id] += out.new_token_ids
        while engine.has_unfinished():
            for out in engine.step():
                got[out.request_id] += out.new_token_ids
        want = {rid: greedy(adapters[name][1], prompt, GREEDY.max_tokens)
                for rid, name in (("a", "all"), ("m", "mlp"))}
        assert got == want
        engine.remove_lora("mlp")
        with pytest.raises(EngineError, match="'mlp' is not loaded"):
            engine.add_request(EngineRequest("again", prompt, GREEDY, lora_name="mlp"))
        with pytest.raises(EngineError, match="'mlp' is not loaded"):
            engine.remove_lora("mlp")
        assert engine.stats().lora.adapters == {"all": adapters["all"][0]}
    finally:
        executor.close()
        for hook in executor.lora._hooks:
            hook.remove()
