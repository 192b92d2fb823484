"""Encoder-only workers (EPD) on a local Ray instance: greedy outputs equal
the colocated engine's, token for token, with chunked prefill and prefix
caching on; a worker that is slow past the deadline or killed mid-run costs
only a local re-encode; published outputs are keyed by processor settings
too; nothing (object-store entry, KV block, encoder reference) is held
after the run: the engine's registry is empty, and the worker, which owns
every published output, lists none and has no object reference left in
Ray's reference table.

The Ray instance and the workers (one per checkpoint, named by its towers'
fingerprint, so every engine here attaches to the same one) are started once
per session; the workers start in parallel while the colocated baselines run.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from utils_engine import assert_pool_clean, make_engine, run_all
from utils_mm import chat_prompt, clip, image, video, write_sensitive_checkpoint

from omnistage.models.loader import load_model
from omnistage.multimodal.processing import MultiModalProcessor
from omnistage.sampling_params import SamplingParams

ray = pytest.importorskip("ray")

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
# Chunked prefill (windows of 16 tokens split the items) and prefix caching on.
ENGINE = {"block_size": 4, "max_num_batched_tokens": 16, "enable_prefix_caching": True}


class Kind:
    def __init__(self, kind: str, root: Path) -> None:
        self.kind = kind
        self.path = write_sensitive_checkpoint(kind, root / kind)
        self.loaded = load_model(self.path)
        self.proc = MultiModalProcessor.from_pretrained(self.path)

    def prompts(self) -> list:
        p = self.proc
        if self.kind == "vl":
            return [
                chat_prompt(p, ["image", "text"], {"image": image(0)}),
                chat_prompt(
                    p,
                    ["text", "image", "text", "image", "image"],
                    {"image": [image(1), image(2, 140, 140), image(3, 300, 50)]},
                ),
                chat_prompt(p, ["video", "text"], {"video": video(0)}),
                chat_prompt(p, ["video", "image", "text"], {"video": (video(1, 4), {"fps": 1.0}), "image": image(4)}),
                chat_prompt(p, ["text", "image"], {"image": image(0)}, text="the same image again"),
                "a plain text request in the same batch",
            ]
        return [
            chat_prompt(p, ["audio", "text"], {"audio": clip(0, 1.3)}),
            chat_prompt(p, ["image", "audio", "text"], {"image": image(1), "audio": clip(1, 2.0)}),
            chat_prompt(p, ["text", "audio"], {"audio": clip(0, 1.3)}, text="that clip once more"),
            "a plain text request in the same batch",
        ]


@pytest.fixture(scope="session")
def kinds(ray_local, tmp_path_factory) -> dict[str, Kind]:
    root = tmp_path_factory.mktemp("epd")
    out = {}
    for name in ("vl", "omni"):
        # Each worker starts as soon as its checkpoint exists: it loads while the rest is prepared.
        out[name] = Kind(name, root)
        out[name].starter = make_engine(out[name].loaded, num_encoder_workers=1, **ENGINE)
    return out


def baseline(kind: Kind, prompts: list, **kw) -> list[list[int]]:
    engine = make_engine(kind.loaded, **{**ENGINE, **kw})
    return [o.outputs[0].token_ids for o in run_all(engine, prompts, GREEDY, prefix="base-")]


def wait_alive(engine, timeout: float = 120.0) -> None:
    pool = engine.remote_encoder
    deadline = time.monotonic() + timeout
    while not pool.num_alive:
        assert time.monotonic() < deadline, "the encoder worker did not start"
        pool.poll()
        time.sleep(0.05)


def assert_nothing_held(engine) -> None:
    """No KV block, encoder reference or published output is held (the engine
    owes one step to drop the last rows; the worker hears the releases in order)."""
    engine.step()
    assert engine.held().is_empty, engine.held()
    assert_pool_clean(engine)
    assert engine.scheduler.encoder_cache_manager.num_referenced_entries == 0
    # The worker owns every published output: it lists none, and Ray tracks no
    # reference to any (ours are dropped; borrowers' releases arrive asynchronously).
    pool = engine.remote_encoder
    deadline = time.monotonic() + 10
    while any(s and (s["published"] or s["objects"]) for s in pool.worker_stats()):
        assert time.monotonic() < deadline, pool.worker_stats()
        time.sleep(0.05)


def run_twice(engine, prompts) -> tuple[list[list[int]], list[list[int]]]:
    first = [o.outputs[0].token_ids for o in run_all(engine, prompts, GREEDY, prefix="a-")]
    second = [o.outputs[0].token_ids for o in run_all(engine, prompts, GREEDY, prefix="b-")]
    return first, second


@pytest.mark.parametrize("kind", ["vl", "omni"])
def test_outputs_equal_the_colocated_engine(kind, kinds):
    """Images and video (Qwen2.5-VL), audio and image (Qwen2.5-Omni thinker),
    with a repeated item and a text request; the second round hits the KV
    prefix cache. Every distinct item is encoded by the worker, none here."""
    k = kinds[kind]
    prompts = k.prompts()
    ref = baseline(k, prompts)
    engine = make_engine(k.loaded, num_encoder_workers=1, **ENGINE)
    wait_alive(engine)
    first, second = run_twice(engine, prompts)
    assert first == ref and second == ref
    distinct = {f.identifier for p in prompts for f in engine.process_inputs("x", p).mm_features}
    assert engine.runner.num_loaded_items == len(distinct)
    assert engine.runner.num_encoded_items == 0 and engine.runner.num_reencoded_items == 0
    assert engine.get_stats().prefix_cache_hit_tokens > 0
    assert_nothing_held(engine)


def test_changed_pixel_bounds_never_hit_old_entries(kinds, tmp_path):
    """The same weights with a processor that resizes images to at most 4
    merged tokens: the same worker serves both engines (same towers), but the
    second engine's keys differ, so its image is encoded again, not taken from
    the first engine's still published entry."""
    k = kinds["vl"]
    small = tmp_path / "small"
    shutil.copytree(k.path, small)
    config = json.loads((small / "processor_config.json").read_text())
    block = config["image_processor"]
    block["max_pixels"] = block["size"]["longest_edge"] = 4 * 28 * 28
    (small / "processor_config.json").write_text(json.dumps(config))
    other = Kind.__new__(Kind)
    other.kind, other.path, other.loaded = "vl", str(small), load_model(str(small))
    other.proc = MultiModalProcessor.from_pretrained(small)
    prompt = chat_prompt(k.proc, ["image", "text"], {"image": image(7)})
    refs = [baseline(k, [prompt]), baseline(other, [prompt])]
    assert refs[0] != refs[1]  # the bounds change what the model sees

    a = make_engine(k.loaded, num_encoder_workers=1, **ENGINE)
    b = make_engine(other.loaded, num_encoder_workers=1, **ENGINE)
    wait_alive(a)
    wait_alive(b)
    assert a.remote_encoder.workers[0].name == b.remote_encoder.workers[0].name  # one worker for both
    assert a.remote_encoder.namespace != b.remote_encoder.namespace
    encoded = a.remote_encoder.worker_stats()[0]["encoded"]
    a.add_request("a", prompt, GREEDY)
    while not a.remote_encoder.ready_ids():  # published, not loaded yet
        a.remote_encoder.poll()
        time.sleep(0.01)
    b.add_request("b", prompt, GREEDY)
    outs = {}
    while a.has_unfinished_requests() or b.has_unfinished_requests():
        for engine in (a, b):
            for out in engine.step():
                if out.finished:
                    outs[out.request_id] = out.outputs[0].token_ids
    assert [outs["a"]] == refs[0] and [outs["b"]] == refs[1]
    assert a.remote_encoder.worker_stats()[0]["encoded"] == encoded + 2  # no hit across namespaces
    assert a.runner.num_loaded_items == 1 and b.runner.num_loaded_items == 1
    for engine in (a, b):
        assert engine.runner.num_reencoded_items == 0
        assert_nothing_held(engine)


def test_late_worker_past_the_deadline_is_encoded_locally(kinds):
    k = kinds["vl"]
    prompts = k.prompts()[:3]
    ref = baseline(k, prompts)
    engine = make_engine(k.loaded, num_encoder_workers=1, encoder_worker_timeout_s=0.2, **ENGINE)
    wait_alive(engine)
    handle = engine.remote_encoder.workers[0].handle
    ray.get(handle.set_delay.remote(0.5))
    try:
        outs = [o.outputs[0].token_ids for o in run_all(engine, prompts, GREEDY)]
    finally:
        ray.get(handle.set_delay.remote(0.0))
    assert outs == ref
    assert engine.runner.num_encoded_items > 0 and engine.remote_encoder.num_failed > 0
    assert_nothing_held(engine)  # the late outputs, published after all, are unlisted too


def test_killed_worker_loses_nothing(kinds):
    """The worker is killed while requests wait on it: every request finishes
    with the colocated engine's tokens; what it had not published is encoded
    here, what it had published and was owned by it is re-encoded too."""
    k = kinds["vl"]
    prompts = k.prompts()
    ref = baseline(k, prompts)
    engine = make_engine(k.loaded, num_encoder_workers=1, **ENGINE)
    wait_alive(engine)
    handle = engine.remote_encoder.workers[0].handle
    ray.get(handle.set_delay.remote(0.3))  # each encode call is slow: requests wait on it
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
    done = {}
    for _ in range(3):
        for out in engine.step():
            done[out.request_id] = out
    ray.kill(handle)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert [done[str(i)].outputs[0].token_ids for i in range(len(prompts))] == ref
    assert all(done[str(i)].error is None for i in range(len(prompts)))
    assert engine.runner.num_encoded_items > 0  # the dead worker's items were encoded here
    engine.step()
    assert engine.held().is_empty, engine.held()
    assert_pool_clean(engine)


def test_arguments_and_text_models(tiny_loaded):
    """The flag is on every command (EngineArgs generates it); a text model
    ignores it (nothing to encode) and starts no worker."""
    import argparse

    from omnistage.engine.arg_utils import EngineArgs

    parsed = EngineArgs.add_cli_args(argparse.ArgumentParser()).parse_args(
        ["--num-encoder-workers", "2", "--encoder-worker-timeout-s", "3.5"]
    )
    assert EngineArgs.cli_kwargs(parsed) == {"num_encoder_workers": 2, "encoder_worker_timeout_s": 3.5}
    for bad in ({"num_encoder_workers": -1}, {"encoder_worker_timeout_s": 0}):
        with pytest.raises(ValueError, match=f"EngineArgs.{next(iter(bad))} is out of range"):
            EngineArgs(**bad)
    engine = make_engine(tiny_loaded("qwen3"), num_encoder_workers=1)
    assert engine.remote_encoder is None and engine.runner.remote_encoder is None


def test_text_request_is_not_held_up_by_an_image_pending_on_a_slow_worker(kinds):
    """An image request whose item sits on a slow worker waits for it: its
    prefill stops before the item, here at 0 tokens (a prefix-cache hit ends
    right at the item), so it stays in the waiting queue. A text request added
    after it starts past it and gets its first token before the image is
    published. Both answers equal the colocated engine's."""
    k = kinds["vl"]
    engine = make_engine(k.loaded, num_encoder_workers=1, **ENGINE)
    words = ""
    while True:  # a text prefix that ends on a block boundary, right before the item
        prompt = {"prompt": f"{words}<|vision_start|><|image_pad|><|vision_end|>describe",
                  "multi_modal_data": {"image": image(5)}}  # fmt: skip
        if engine.process_inputs("x", prompt).mm_features[0].mm_position.offset % ENGINE["block_size"] == 0:
            break
        words += "a"
    prompts = [prompt, "a plain text request behind it"]
    ref = baseline(k, prompts)
    wait_alive(engine)
    warm = {"prompt": prompt["prompt"], "multi_modal_data": {"image": image(6)}}  # caches the text prefix
    run_all(engine, [warm], GREEDY, prefix="warm-")
    handle = engine.remote_encoder.workers[0].handle
    ray.get(handle.set_delay.remote(1.5))
    try:
        engine.add_request("img", prompts[0], GREEDY)
        engine.add_request("txt", prompts[1], GREEDY)
        first: dict[str, bool] = {}  # request -> whether the image was still on the worker at its first token
        done = {}
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.outputs[0].token_ids and out.request_id not in first:
                    first[out.request_id] = bool(engine.remote_encoder.pending_ids())
                if out.finished:
                    done[out.request_id] = out.outputs[0].token_ids
    finally:
        ray.get(handle.set_delay.remote(0.0))
    assert [done["img"], done["txt"]] == ref
    assert list(first) == ["txt", "img"] and first == {"txt": True, "img": False}
    assert engine.runner.num_loaded_items == 2 and engine.runner.num_encoded_items == 0
    assert engine.get_stats().prefix_cache_hit_tokens > 0
    assert_nothing_held(engine)


def test_a_worker_call_of_several_items_gives_each_item_s_own_rows(kinds):
    """One worker call encodes a request's items together (one tower call per
    modality, the colocated engine's path); the rows are bit for bit the ones
    each item gets alone, images of different sizes and a video alike."""
    from omnistage.worker.mm.encoder_worker import EncodeItem

    k = kinds["vl"]
    prompts = [chat_prompt(k.proc, ["image", "text"], {"image": image(20 + i, 100 + 20 * i, 90)}) for i in range(4)]
    prompts.append(chat_prompt(k.proc, ["video", "text"], {"video": video(3)}))
    engine = make_engine(k.loaded, num_encoder_workers=1, **ENGINE)
    wait_alive(engine)
    handle = engine.remote_encoder.workers[0].handle
    features = [f for p in prompts for f in engine.process_inputs("x", p).mm_features]

    def items(tag: str) -> list[EncodeItem]:
        return [EncodeItem(f"{tag}/{i}", f.modality, f.data, f.mm_position.get_num_embeds()) for i, f in enumerate(features)]

    batched = ray.get(ray.get(handle.encode.remote("check", items("batch"))))
    alone = [ray.get(ray.get(handle.encode.remote("check", [item]))[0]) for item in items("alone")]
    ray.get(handle.release.remote("check", [it.key for it in items("batch") + items("alone")]))
    assert len(batched) == len(features) and all(torch.equal(a, b) for a, b in zip(batched, alone))


def test_aborting_a_request_waiting_on_a_worker_releases_its_output_at_once(kinds):
    """A request that waits at 0 tokens for its item on a worker is aborted: no step is owed
    after it, so the abort itself releases the worker's output (nothing stays published)."""
    k = kinds["vl"]
    engine = make_engine(k.loaded, num_encoder_workers=1, **ENGINE)
    wait_alive(engine)
    pool = engine.remote_encoder
    handle = pool.workers[0].handle
    ray.get(handle.set_delay.remote(1.0))
    try:
        engine.add_request("waits", {"prompt": "<|image_pad|>describe", "multi_modal_data": {"image": image(11)}},
                           GREEDY)  # fmt: skip
        engine.step()
        engine.step()
        assert pool.pending_ids() and engine.get_stats().num_waiting_reqs == 1
        engine.abort_request("waits")
    finally:
        ray.get(handle.set_delay.remote(0.0))
    assert not engine.has_unfinished_requests() and engine.held().is_empty, engine.held()
    deadline = time.monotonic() + 10
    while any(s and (s["published"] or s["objects"]) for s in pool.worker_stats()):  # published after the abort
        assert time.monotonic() < deadline, pool.worker_stats()
        time.sleep(0.05)
