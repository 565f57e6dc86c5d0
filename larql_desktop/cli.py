"""Command line: `larql-desktop` opens the app; subcommands serve scripts and checks."""
from __future__ import annotations

import argparse
import logging
import sys
import time

import larql_desktop
from larql_desktop.engine import services
from larql_desktop.engine.catalog import DEFAULT_MODEL, PACKAGED_MODELS

MODEL_HELP = f"{' | '.join(PACKAGED_MODELS)} | PATH to a llama or gemma3 GGUF (default {DEFAULT_MODEL})"


def _progress_to_stderr(message: str, fraction: float) -> None:
    print(f"[{fraction * 100:5.1f}%] {message}", file=sys.stderr, flush=True)


def _load(args, quiet_progress: bool = False, preload: str = "none"):
    """The model of `args`; sessions are made on first use unless `preload` names a set to make now (a
    command that runs once pays the same either way, and makes none it does not use)."""
    from larql_desktop.engine.paths import AppPaths
    from larql_desktop.engine.loading import load_model

    paths = AppPaths.from_environment().ensure()
    progress = None if quiet_progress else _progress_to_stderr
    return load_model(args.model, paths, threads=args.threads, progress=progress, preload=preload)


def _capture_store():
    """INSERT's negatives' captures kept between runs, in the user cache directory."""
    from larql_desktop.engine.paths import AppPaths
    from larql_desktop.engine.patches.insert.capture_store import CaptureStore

    return CaptureStore(AppPaths.from_environment().ensure().insert_captures)


def cmd_chat(args) -> int:
    from larql_desktop.engine.model.generation import SamplingSettings
    from larql_desktop.engine.core import LarqlEngine

    settings = SamplingSettings(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                seed=args.seed)
    # A dense chat runs whole passes in the decoder graph: the per-layer sessions are not needed.
    model = _load(args, quiet_progress=True, preload="decoder" if args.ffn == "dense" else "layers")
    print(f"loaded {model.name} in {model.load_seconds:.2f} s ({model.threads} threads)", file=sys.stderr)
    engine = LarqlEngine(model, walk=_walk_settings(args))
    for path in args.patch or ():
        patches = engine.read_patches(path)
        engine.apply_patches(patches)
        for patch in patches:
            print(f"patch {path}{f' ({patch.name})' if len(patches) > 1 else ''}: {len(patch.operations)} "
                  f"operation(s) on layer(s) {', '.join(map(str, patch.layers))}", file=sys.stderr)
    session = engine.new_session()
    decode_seconds = 0.0
    decode_tokens = 0
    first = None
    for step in session.reply(args.prompt, settings):
        if step.index == 0:
            first = step
        else:
            decode_seconds += step.seconds
            decode_tokens += 1
        if step.text:
            sys.stdout.write(step.text)
            sys.stdout.flush()
    sys.stdout.write("\n")
    rate = decode_tokens / decode_seconds if decode_seconds else float("nan")
    snap = engine.session_snapshot(session)
    print(f"prefill: {first.prompt_tokens} tokens in {first.seconds:.3f} s; decode: {decode_tokens} tokens at "
          f"{rate:.1f} tok/s; cache: {snap.hits} hits in {snap.lookups} decode lookups, "
          f"{snap.bypass_total} bypasses", file=sys.stderr)
    if args.explain_misses:
        from larql_desktop.engine.cache.near_miss import describe
        from larql_desktop.engine.cache.keys import default_top_k

        k = engine.walk_settings.top_k or default_top_k(model.config.intermediate)
        print(f"near misses: {describe(snap.near_miss, k / model.config.intermediate)}", file=sys.stderr)
        sampler = session.ffn.near_miss
        if sampler is not None and sampler.miss_seconds:
            print(f"explaining took {100 * sampler.spent / sampler.miss_seconds:.1f}% of the misses' own time "
                  f"({sampler.skipped_for_budget} sampled misses skipped to stay within "
                  f"{100 * sampler.budget:.0f}%)", file=sys.stderr)
        if args.json:
            import json

            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(snap.to_dict(), f, indent=1)
    return 0


def cmd_verify_reference(args) -> int:
    from larql_desktop.tools.verify_reference import check_model, format_summary, model_key_for, read_reference

    doc = read_reference(args.file)
    results = []
    for name, entry in doc["models"].items():
        key = model_key_for(name, entry)
        if args.model and args.model not in (name, key):
            continue
        if key is None:
            print(f"{name}: no packaged model matches this reference entry; skipped", file=sys.stderr)
            continue
        print(f"{name} (model {key}):")
        args_for = argparse.Namespace(model=key, threads=args.threads)
        model = _load(args_for, quiet_progress=True)
        results.append(check_model(model, name, entry))
    if not results:
        print("no model in the reference file was checked", file=sys.stderr)
        return 2
    for line in format_summary(results):
        print(line)
    return 0


def _walk_settings(args):
    from larql_desktop.engine.cache.walk import WalkSettings

    return WalkSettings(top_k=getattr(args, "top_k", None), dense=getattr(args, "ffn", "walk") == "dense",
                        key_width=getattr(args, "key_k", None), cosine_guard=getattr(args, "guard", None),
                        feature_set_hits=getattr(args, "feature_set_hits", False),
                        near_miss_fraction=getattr(args, "explain_misses", 0.0))


def cmd_bench_ffn_cache(args) -> int:
    from larql_desktop.tools.measure import bench_ffn_cache, format_bench

    model = _load(args, quiet_progress=True)
    walk = _walk_settings(args).resolved(model.config.intermediate)
    layer = model.config.n_layers // 2 if args.layer is None else args.layer
    rows = bench_ffn_cache(model, layer, walk.top_k, args.iters)
    for line in format_bench(model, layer, rows, walk.top_k):
        print(line)
    return 0


def cmd_bench_batch(args) -> int:
    from larql_desktop.tools.measure import bench_batched_decoders, format_bench_batch, parse_sweep

    rows = parse_sweep(args.rows, "--rows", int)     # bench_batched_decoders checks the counts themselves
    if None in rows:
        raise ValueError(f"--rows: row counts of at least 1, comma-separated, not {args.rows!r}")
    model = _load(args, quiet_progress=True)
    top_k = _walk_settings(args).resolved(model.config.intermediate).top_k
    results = bench_batched_decoders(model, top_k, rows, context=args.context, steps=args.steps)
    for line in format_bench_batch(model, top_k, args.context, results):
        print(line)
    return 0


def cmd_hitrates(args) -> int:
    import json

    from larql_desktop.tools.measure import format_hitrates, read_scenarios, run_hitrates

    scenarios = read_scenarios(args.scenarios)
    walk = _walk_settings(args)
    model = _load(args, quiet_progress=True)
    walk.resolved(model.config.intermediate)
    results = run_hitrates(model, scenarios, walk, max_tokens=args.max_tokens,
                           log=lambda line: print(line, file=sys.stderr, flush=True))
    for line in format_hitrates(model, walk, results):
        print(line)
    if args.json:
        resolved = walk.resolved(model.config.intermediate)
        doc = {name: r.to_dict() for name, r in results.items()}
        doc["_run"] = {"model": model.name, "top_k": resolved.top_k, "key_width": resolved.key_width,
                       "cosine_guard": resolved.cosine_guard, "max_tokens": args.max_tokens}
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=1)
    return 0


def cmd_collapse(args) -> int:
    import json

    from larql_desktop.engine.analysis.collapse import collapse, format_report

    if len(args.prompts) < 2:
        raise ValueError("collapse compares at least two prompts")
    model = _load(args, quiet_progress=True)
    report = collapse(model, args.prompts, top_k=args.top_k, key_width=args.key_k)
    for line in format_report(report):
        print(line)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(report.to_dict(), f, indent=1)
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


def cmd_frontier(args) -> int:
    import json

    from larql_desktop.tools.measure import format_frontier, parse_sweep, run_frontier

    widths = parse_sweep(args.widths, "--widths", int)
    taus = parse_sweep(args.taus, "--taus", float)
    model = _load(args, quiet_progress=True)
    points, bounds = run_frontier(model, args.prompts, widths, taus, walk=_walk_settings(args),
                                  max_tokens=args.max_tokens, log=lambda line: print(line, file=sys.stderr, flush=True))
    top_k = _walk_settings(args).resolved(model.config.intermediate).top_k
    for line in format_frontier(model, top_k, points, bounds, len(args.prompts)):
        print(line)
    if args.json:
        doc = {"model": model.name, "top_k": top_k, "intermediate": model.config.intermediate,
               "prompts": args.prompts, "max_tokens": args.max_tokens, "feature_set_hits": args.feature_set_hits,
               "designs": [p.to_dict() for p in points], "bounds": [b.to_dict() for b in bounds]}
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(doc, f, indent=1)
    return 0


def cmd_bench(args) -> int:
    import json

    from larql_desktop.tools.bench import DEFAULT_PROMPT, LARQL_MODES, format_report, run_bench

    doc = run_bench(args.model, args.threads, args.tokens, args.prompt or DEFAULT_PROMPT, args.runs,
                    modes=tuple(m.strip() for m in args.modes.split(",")) if args.modes else LARQL_MODES,
                    llama=False if args.no_llama_cpp else None,
                    log=lambda line: print(line, file=sys.stderr, flush=True))
    for line in format_report(doc):
        print(line)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=1)
    return 0


def _show(label: str, text: str) -> None:
    print(f"{label}: {text!r}")


def cmd_insert(args) -> int:
    from larql_desktop.engine.core import LarqlEngine
    from larql_desktop.engine.patches.insert import Fact

    fact = Fact(args.entity, args.relation, args.target)
    model = _load(args, quiet_progress=True)
    engine = LarqlEngine(model, walk=_walk_settings(args), capture_store=_capture_store())
    token = engine.inserter().target_token(fact.target)
    print(f"model {model.name}, FFN {'dense' if engine.walk_settings.dense else 'walk'}; "
          f"target token {model.tokenizer.decode([token])!r}")
    started = time.perf_counter()
    result = engine.insert(fact, layer=args.layer, alpha=args.alpha, progress=_progress_to_stderr,
                           paraphrases=args.paraphrase or ())
    seconds = time.perf_counter() - started
    installed = ", ".join(f"layer {f.layer} feature {f.feature} -> {model.tokenizer.decode([f.token])!r}"
                          for f in result.features)
    print(f"inserted ({fact.entity}, {fact.relation}, {fact.target}) in {seconds:.1f} s: {installed}; "
          f"canonical prompt {fact.canonical_prompt!r}")
    probe = services.probe(engine, args.probe, fact.target, args.tokens)
    control = services.probe(engine, args.control, "", args.tokens)
    _show("probe before", args.probe + probe.base_text)
    _show("control before", args.control + control.base_text)
    _show("probe after", args.probe + probe.patched_text)
    _show("control after", args.control + control.patched_text)
    if args.save:
        result.patch.save(args.save)
        print(f"saved patch to {args.save}")
    print(f"target p: {probe.base_probability:.4f} -> {probe.patched_probability:.4f}; control unchanged: "
          f"{'yes' if control.base_text == control.patched_text else 'no'}")
    if args.show_probes:
        # The patch editor's fact probe table: P is the whole target word's probability.
        print("fact probes (kind, P(target) before -> after, answers before -> after, prompt, before, after):")
        for row in services.fact_probes(engine, fact, args.paraphrase or ()):
            print(f"  {row.kind} {row.p_before:.4f} -> {row.p_after:.4f} "
                  f"{'yes' if row.answers_before else 'no'} -> {'yes' if row.answers_after else 'no'} "
                  f"{row.prompt!r} {row.before!r} {row.after!r}")
    return 0


def cmd_insert_eval(args) -> int:
    import json

    from larql_desktop.tools.insert_eval import default_engine_factory, format_report, read_facts, run_insert_eval

    facts, controls = read_facts(args.facts, generate_conversations=not args.no_generated_conversations)
    if args.limit is not None:
        if args.limit < 1:
            raise ValueError(f"--limit must be at least 1, not {args.limit}")
        facts = facts[:args.limit]
    model = _load(args, quiet_progress=True)
    store = None if args.no_capture_store else _capture_store()
    engines = default_engine_factory(model, dense=args.ffn == "dense", capture_store=store)
    report = run_insert_eval(engines, facts, controls,
                             use_paraphrases=args.use_paraphrases, together=args.together, alone_only=args.alone,
                             log=lambda line: print(line, file=sys.stderr, flush=True))
    for line in format_report(report):
        print(line)
    if store is not None:       # whether the inserts' passes ran or were read (a relation met in an earlier run)
        stats = store.stats()
        print(f"capture store: {stats['hits']} read, {stats['misses']} computed ({stats['path']})")
    if args.json:
        doc = report.to_dict()
        doc["capture_store"] = store.stats() if store is not None else None
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=1)
    return 0


def cmd_patch(args) -> int:
    from larql_desktop.engine.core import LarqlEngine

    model = _load(args, quiet_progress=True)
    engine = LarqlEngine(model, walk=_walk_settings(args))
    patches = engine.read_patches(args.file)      # a patch file, or a patch set file (all of its patches)
    for patch in patches:
        layers = ", ".join(str(layer) for layer in patch.layers)
        print(f"valid: {len(patch.operations)} operation(s) on layer(s) {layers} for {model.name}"
              + (f" ({patch.name})" if len(patches) > 1 else "")
              + (f" — {patch.description}" if patch.description else ""))
    if args.action == "validate":
        return 0
    engine.apply_patches(patches)
    outcome = services.probe(engine, args.probe, "", args.tokens)
    _show("probe before", args.probe + outcome.base_text)
    _show("probe after", args.probe + outcome.patched_text)
    # One line per inserted target (a multi-token, multi-layer insert has several features for one target).
    operations = [op for patch in patches for op in patch.operations]
    for target in dict.fromkeys(op.target for op in operations if op.op == "insert" and op.target):
        p = services.probe(engine, args.probe, target, 1)
        where = sorted({(o.layer, o.feature) for o in operations if o.target == target})
        print(f"target {target!r} ({', '.join(f'layer {l} feature {f}' for l, f in where)}) first token p: "
              f"{p.base_probability:.4f} -> {p.patched_probability:.4f}")
    return 0


def cmd_self_test(args) -> int:
    """Load the model, generate, check the cache, and start Qt offscreen: checks an install or a build."""
    from larql_desktop.engine.paths import AppPaths
    from larql_desktop.tools.selftest import run_self_test
    from larql_desktop.qt.smoke import qt_smoke_test

    run_self_test(AppPaths.from_environment().ensure(), args.model, threads=args.threads)
    print(f"Qt {qt_smoke_test()} platform and pyqtgraph work")
    print("self-test passed")
    return 0


def _stop_on_interrupt_and_terminate() -> None:
    """SIGINT and SIGTERM end `serve` the same way, through its cleanup (the L3 queue is written). A process
    started in the background by a shell without job control inherits SIGINT ignored, and Python keeps it so:
    there `kill -INT` would do nothing, and a plain SIGTERM would drop the queue."""
    import signal
    import threading

    def stop(signum, frame):
        raise KeyboardInterrupt
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, stop)


def cmd_serve(args) -> int:
    """The local HTTP API over a headless engine (with the default persistent L3 unless --l3 says otherwise)."""
    import gc
    import os

    from larql_desktop.engine.core import LarqlEngine
    from larql_desktop.engine.cache.l3 import L3Settings, open_l3
    from larql_desktop.engine.paths import AppPaths
    from larql_desktop.api.server import start_server

    token = args.token or os.environ.get("LARQL_DESKTOP_API_TOKEN") or None
    if not services.is_loopback(args.host) and not token:
        raise ValueError(f"--host {args.host} is not loopback: give a token (--token or LARQL_DESKTOP_API_TOKEN)")
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port must be within 0..65535, not {args.port}")
    l3_settings = L3Settings(dtype="float16" if args.l3_fp16 else "float32", max_bytes=args.l3_max_mb << 20)
    paths = AppPaths.from_environment().ensure()
    store = open_l3(args.l3, paths, l3_settings)
    model = _load(args, quiet_progress=True)
    if args.prefix_cache_mb < 0 or args.prefill_chunk < 1 or args.batch_rows < 0:
        raise ValueError("--prefix-cache-mb and --batch-rows must be 0 (off) or more and --prefill-chunk at least 1")
    engine = LarqlEngine(model, walk=_walk_settings(args), l3=store, prefix_cache_bytes=args.prefix_cache_mb << 20,
                         prefill_chunk=args.prefill_chunk, capture_store=_capture_store())
    # The first request per layer would otherwise build its sessions.
    model.ffn.load_sessions(kinds=("gate", "walk"))
    handle = start_server(engine, args.host, args.port, token, batch_rows=args.batch_rows, preload_batch=True)
    # What start-up made (modules, the web stack, the model's and tokenizer's objects: ~70k objects the cycle
    # collector tracks) lives as long as the process: moved out of its collections, which otherwise walked it
    # all in each full collection (every few seconds of a busy server, every thread stopped for 50-90 ms).
    gc.freeze()
    _stop_on_interrupt_and_terminate()
    print(f"serving {model.name} on {handle.url} (L3: {store.status()['where'] if store else 'off'}); "
          "Ctrl-C stops", flush=True)
    try:
        handle.wait()
    except KeyboardInterrupt:
        pass
    finally:
        handle.stop()
        if store is not None:
            store.close()
    return 0


def display_problem(env=None) -> str | None:
    """Why a window cannot open here, before Qt aborts with a cryptic platform-plugin message."""
    import os

    env = os.environ if env is None else env
    if sys.platform.startswith("linux") and not (env.get("QT_QPA_PLATFORM") or env.get("DISPLAY")
                                                 or env.get("WAYLAND_DISPLAY")):
        return ("no display to open the window on (neither DISPLAY nor WAYLAND_DISPLAY is set): run it in a "
                "desktop session, or check a headless install with `larql-desktop --self-test`")
    return None


def cmd_gui(args) -> int:
    if args.self_test:
        return cmd_self_test(args)
    problem = display_problem()
    if problem:
        raise OSError(problem)
    from larql_desktop.qt.app import run_app

    return run_app(args, serve=serve_api)


def serve_api(engine, host: str, port: int):
    """How the app's HTTP API toggle serves an engine: given to the app here, so the Qt layer never imports the
    web stack (FastAPI and uvicorn load only when the user turns serving on)."""
    from larql_desktop.api.server import start_server

    return start_server(engine, host, port)


class _VersionAction(argparse.Action):
    """argparse's "version" action, reading the version only when asked (see larql_desktop.__getattr__)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                 help="show program's version number and exit"):
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"{parser.prog} {larql_desktop.__version__}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="larql-desktop", description=__doc__)
    parser.add_argument("--version", action=_VersionAction)
    parser.add_argument("--model", default=DEFAULT_MODEL, help=MODEL_HELP)
    parser.add_argument("--threads", type=int, default=2, help="threads for onnxruntime (default 2)")
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    parser.add_argument("--self-test", action="store_true",
                        help="load the model, generate a few tokens, exercise the cache, start Qt offscreen, exit")
    sub = parser.add_subparsers(dest="command")

    def common(p):
        p.add_argument("--model", default=argparse.SUPPRESS, help=MODEL_HELP)
        p.add_argument("--threads", type=int, default=argparse.SUPPRESS, help="threads for onnxruntime")

    chat = sub.add_parser("chat", help="print a reply to one prompt")
    common(chat)
    chat.add_argument("--max-tokens", type=int, default=128)
    chat.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    chat.add_argument("--top-p", type=float, default=1.0)
    chat.add_argument("--seed", type=_non_negative_int, default=None, help="sampling seed (a non-negative integer)")
    chat.add_argument("--ffn", choices=("dense", "walk"), default="dense",
                      help="dense FFN (default: plain inference) or LARQL's walk FFN with the L1/L2 cache")
    chat.add_argument("--top-k", type=int, default=None, help="walk FFN K (default 79%% of the FFN width)")
    chat.add_argument("--explain-misses", type=float, default=0.0, metavar="FRACTION",
                      help="walk FFN: explain this share of cache misses (nearest stored entry by feature overlap "
                           "and by cosine; time-capped at 5%% of the misses') and print the summary")
    chat.add_argument("--json", default=None, help="with --explain-misses: write the session's statistics here")
    chat.add_argument("--patch", action="append", default=None, metavar="FILE",
                      help="apply this patch or patch set file first (repeatable, applied in order)")
    chat.add_argument("prompt")
    chat.set_defaults(func=cmd_chat)

    verify = sub.add_parser("verify-reference", help="compare the engine with outputs recorded from llama.cpp")
    verify.add_argument("file")
    verify.add_argument("--model", default=None, help="only this model (reference name or packaged key)")
    verify.add_argument("--threads", type=int, default=argparse.SUPPRESS)
    verify.set_defaults(func=cmd_verify_reference)
    bench = sub.add_parser("bench-ffn-cache", help="the seed's one-layer cache benchmark")
    common(bench)
    bench.add_argument("--layer", type=int, default=None, help="layer to benchmark (default: the middle one)")
    bench.add_argument("--top-k", type=int, default=None, help="K features (default 79%% of the FFN width)")
    bench.add_argument("--iters", type=int, default=200)
    bench.set_defaults(func=cmd_bench_ffn_cache)
    batch = sub.add_parser("bench-batch", help="the batched decoders' speed by rows: what batching clients can gain")
    common(batch)
    batch.add_argument("--rows", default="1,2,4,8", help="row counts (sequences decoded in one call)")
    batch.add_argument("--context", type=int, default=128, help="each row's position in its KV cache")
    batch.add_argument("--steps", type=int, default=30, help="timed steps per row count and round")
    batch.add_argument("--top-k", type=int, default=None, help="walk FFN K (default 79%% of the FFN width)")
    batch.set_defaults(func=cmd_bench_batch)

    hit = sub.add_parser("hitrates", help="the seed's expected-hit-rate scenarios, measured")
    common(hit)
    hit.add_argument("--scenarios", required=True, help="scenario file (hitrate_scenarios.json format)")
    hit.add_argument("--top-k", type=int, default=None, help="K features (default 79%% of the FFN width)")
    hit.add_argument("--key-k", type=int, default=None, help="key on the top k' of the K ids (default K)")
    hit.add_argument("--guard", type=float, default=None,
                     help="cosine guard tau for a hit, with norms within 5%% (default off: a hit needs the same input)")
    hit.add_argument("--feature-set-hits", action="store_true",
                     help="the seed's semantics: any entry under the key is a hit, whatever input made it (for "
                          "study of approximate keys; unsafe where untrusted clients share the cache)")
    hit.add_argument("--max-tokens", type=int, default=32, help="tokens per generation (default 32)")
    hit.add_argument("--json", default=None, help="also write the figures to this JSON file")
    hit.set_defaults(func=cmd_hitrates)
    coll = sub.add_parser("collapse", help="do paraphrases collapse? per layer: cosine of the normed FFN inputs, "
                          "top-K overlap and key equality of two or more prompts")
    common(coll)
    coll.add_argument("--top-k", type=int, default=None, help="K features (default 79%% of the FFN width)")
    coll.add_argument("--key-k", type=int, default=None, help="key on the top k' of the K ids (default K)")
    coll.add_argument("--json", default=None, help="also write the figures to this JSON file")
    coll.add_argument("prompts", nargs="+", metavar="PROMPT")
    coll.set_defaults(func=cmd_collapse)
    front = sub.add_parser("frontier", help="key width k' x cosine guard tau: hit rate against fidelity to the "
                           "cache-off run, beside the nearest-neighbour bound at each tau")
    common(front)
    front.add_argument("--top-k", type=int, default=None, help="K features (default 79%% of the FFN width)")
    front.add_argument("--widths", default="K,64,8,1", help="key widths k' to sweep, K = all K ids (default K,64,8,1)")
    front.add_argument("--taus", default="off,0.999,0.995,0.99",
                       help="cosine guards to sweep, off = none (default off,0.999,0.995,0.99)")
    front.add_argument("--feature-set-hits", action="store_true",
                       help="tau off means the seed's semantics (any entry under the key serves), not the default "
                            "(a hit needs the entry's own input)")
    front.add_argument("--max-tokens", type=int, default=24, help="tokens per generation (default 24)")
    front.add_argument("--json", default=None, help="also write the figures to this JSON file")
    front.add_argument("prompts", nargs="+", metavar="PROMPT")
    front.set_defaults(func=cmd_frontier)
    bench_all = sub.add_parser("bench", help="prefill/decode speed, time to first token and peak RSS of each FFN "
                               "configuration, and llama.cpp's on the same GGUF when llama_cpp is installed")
    common(bench_all)
    bench_all.add_argument("--tokens", type=int, default=64, help="tokens generated per run (default 64)")
    bench_all.add_argument("--prompt", default=None, help="prompt (default: a two-sentence question)")
    bench_all.add_argument("--runs", type=int, default=5, help="runs per configuration; medians are reported")
    bench_all.add_argument("--modes", default=None, help="comma-separated subset of dense,layered,sparse,cold,warm,app")
    bench_all.add_argument("--no-llama-cpp", action="store_true", help="skip llama.cpp even if it is installed")
    bench_all.add_argument("--json", default=None, help="also write the figures to this JSON file")
    bench_all.set_defaults(func=cmd_bench)
    ins = sub.add_parser("insert", help="INSERT a fact and show the probe before and after")
    common(ins)
    ins.add_argument("--entity", required=True)
    ins.add_argument("--relation", required=True, help="e.g. capital-of")
    ins.add_argument("--target", required=True)
    ins.add_argument("--layer", type=int, default=None, help="install layer (default: LARQL's, then neighbours)")
    ins.add_argument("--alpha", type=float, default=0.1, help="initial down-vector scale (default 0.1)")
    ins.add_argument("--paraphrase", action="append", default=None, metavar="P",
                     help="another phrasing of the question to key on (repeatable; phrasings generated from the "
                          "relation are always used)")
    ins.add_argument("--probe", required=True, help="prompt whose continuation should become the target")
    ins.add_argument("--control", default="Once upon a time,", help="prompt whose continuation must not change")
    ins.add_argument("--save", default=None, help="write the patch to this file")
    ins.add_argument("--tokens", type=int, default=8, help="tokens of greedy continuation shown (default 8)")
    ins.add_argument("--ffn", choices=("walk", "dense"), default="walk", help="FFN to run (default walk)")
    ins.add_argument("--show-probes", action="store_true",
                     help="print the fact probe table: the canonical prompt, the paraphrases (or generated ones) "
                          "and a chat question, before and after")
    ins.set_defaults(func=cmd_insert)

    ev = sub.add_parser("insert-eval", help="INSERT each fact of a facts file and measure canonical prompts, "
                        "paraphrases, chat questions, neighbours and controls (greedy)")
    common(ev)
    ev.add_argument("--facts", required=True, help="facts file (insert_generalization.json format)")
    ev.add_argument("--json", default=None, help="also write the figures and every output to this JSON file")
    ev.add_argument("--ffn", choices=("dense", "walk"), default="dense", help="FFN to run (default dense)")
    ev.add_argument("--use-paraphrases", action="store_true",
                    help="hand the file's paraphrases to INSERT too (default: it sees only the fact, so the "
                         "paraphrases measure generalisation)")
    ev.add_argument("--limit", type=int, default=None, help="only the first N facts")
    ev.add_argument("--together", type=int, default=None, metavar="N",
                    help="install the first N facts together (all kept, no one-at-a-time pass), then measure "
                         "every one, the neighbours and the controls, and remove one")
    ev.add_argument("--alone", action="store_true", help="only install each fact alone (no together pass)")
    ev.add_argument("--no-generated-conversations", action="store_true",
                    help="only the file's own conversation cases, none generated from the relations")
    ev.add_argument("--no-capture-store", action="store_true",
                    help="do not read or keep the negatives' captures on disk (every insert's passes run cold, "
                         "as on a first launch)")
    ev.set_defaults(func=cmd_insert_eval)

    patch = sub.add_parser("patch", help="validate or apply a patch file (or a patch set file)")
    patch_sub = patch.add_subparsers(dest="action", required=True)
    for action in ("validate", "apply"):
        p = patch_sub.add_parser(action)
        common(p)
        p.add_argument("file")
        p.add_argument("--ffn", choices=("walk", "dense"), default="walk")
        p.add_argument("--tokens", type=int, default=8)
        if action == "apply":
            p.add_argument("--probe", required=True)
        p.set_defaults(func=cmd_patch)
    selftest = sub.add_parser("self-test", help="same as --self-test")
    common(selftest)
    selftest.set_defaults(func=cmd_self_test)

    serve = sub.add_parser("serve", help="the local HTTP API (walk FFN, cache stats, patches, and the "
                                          "OpenAI-compatible /v1/chat/completions) without the app")
    common(serve)
    serve.add_argument("--host", default=services.DEFAULT_API_HOST, help="address to bind (default loopback; others need a token)")
    serve.add_argument("--port", type=int, default=services.DEFAULT_API_PORT,
                       help=f"port (default {services.DEFAULT_API_PORT}; 0 picks a free one)")
    serve.add_argument("--token", default=None,
                       help="bearer token every request must carry (default $LARQL_DESKTOP_API_TOKEN)")
    serve.add_argument("--top-k", type=int, default=None, help="default K (default 79%% of the FFN width)")
    serve.add_argument("--l3", default="sqlite",
                       help="persistent tier: sqlite (default, in the user cache dir), sqlite:PATH, "
                            "redis://HOST:PORT/DB[#PREFIX] or off")
    serve.add_argument("--l3-fp16", action="store_true", help="store L3 values as fp16 (half the bytes)")
    serve.add_argument("--l3-max-mb", type=int, default=512, help="L3 size cap in MiB (default 512)")
    serve.add_argument("--prefix-cache-mb", type=int, default=256,
                       help="KV prefix cache shared by every request, in MiB (0: off; default 256)")
    serve.add_argument("--prefill-chunk", type=int, default=64,
                       help="positions per prefill pass; other requests run between chunks (default 64)")
    serve.add_argument("--ffn", choices=("walk", "dense"), default="walk",
                       help="LARQL's walk FFN with the L1/L2/L3 cache (default) or the plain dense FFN")
    serve.add_argument("--batch-rows", type=int, default=8,
                       help="replies decoding together in one forward pass per step, dense or walked "
                            "(0: one at a time, in turns; default 8)")
    serve.set_defaults(func=cmd_serve)
    parser.set_defaults(func=cmd_gui)
    return parser


def _non_negative_int(text: str) -> int:
    """argparse type: argparse names the option in the error ("argument --seed: ...")."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, not {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a non-negative integer, not {value}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads < 1 or args.threads > 256:
        parser.error(f"--threads must be between 1 and 256, not {args.threads}")
    from larql_desktop.engine.graphs.store import share_thread_pool

    share_thread_pool(args.threads)   # this process makes no onnxruntime sessions but the engine's
    try:
        return args.func(args)
    except (ValueError, OSError, FloatingPointError) as exc:   # GgufError, PatchError, bad settings, a damaged
        # model computing NaN, self-test failures
        print(f"larql-desktop: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
