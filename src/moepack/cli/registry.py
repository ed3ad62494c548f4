"""Every ``moepack`` command: its name, the module and attribute that define it, and its
summary (the first paragraph of its help).

``moepack --help`` lists the commands from this table alone, and running one imports only
its module (``lazy.LazyGroup``). Every command module defines its commands as module-level
click commands; the groups (``trace``, ``store``, ``npu`` and its ``txn``, ``surface``) have
no options of their own and are defined here. Adding a command is writing it in its module
and adding its line here; ``tests/cli/test_cli_lazy.py`` fails when a line and its command
disagree.
"""

from __future__ import annotations

from .lazy import CommandGroup, Entry, LazyCommand

TRACE = CommandGroup(
    "Routing traces: which experts the router chose, per token and layer.",
    {
        "capture": LazyCommand(
            "llama",
            "capture_cmd",
            "Run MODEL in llama.cpp and record every token's top-k experts per MoE layer.",
        ),
        "convert": LazyCommand(
            "trace",
            "convert_cmd",
            "Convert trace IN to OUT. What OUT's format cannot carry is listed as dropped. "
            "With --model the trace is checked against the model and bound to it (fingerprint "
            "and block map recorded where the output format can carry them).",
        ),
        "formats": LazyCommand(
            "trace", "formats_cmd", "List the trace formats moepack reads and writes."
        ),
        "info": LazyCommand(
            "trace",
            "info_cmd",
            "Validate TRACE and show its shape, binding and routing statistics.",
        ),
        "stats": LazyCommand(
            "trace_stats",
            "stats_cmd",
            "Popularity, reuse, co-activation lift, layer-to-layer predictability and the "
            "exact LRU hit-rate curve of TRACE, per layer, for all tokens and for decode tokens.",
        ),
        "synth": LazyCommand(
            "trace",
            "synth_cmd",
            "Write a synthetic trace with planted structure to OUT, for --model or for "
            "--layers/--experts/--top-k. The ground truth (cluster of every expert) is kept in "
            "the native format's provenance.",
        ),
    },
)

STORE = CommandGroup(
    "Expert-major stores: each routed expert's slices in one aligned record.",
    {
        "build": LazyCommand(
            "store",
            "build_cmd",
            "Write MODEL's routed experts as an expert-major store (dense tensors, routers and "
            "shared experts stay in MODEL).",
        ),
        "info": LazyCommand(
            "store",
            "info_cmd",
            "What STORE holds: its model, blocks, parts and types, per block.",
        ),
        "precision": LazyCommand(
            "store",
            "precision_cmd",
            "Give MODEL's hot experts more bits and cold ones fewer, under a byte budget, from "
            "TRACE's per-expert counts.",
        ),
        "verify": LazyCommand(
            "store",
            "verify_cmd",
            "Check every slice of STORE against MODEL and every record's checksum; exit 1 "
            "naming the first wrong slice.",
        ),
    },
)

SURFACE = CommandGroup(
    "Show, query, convert and plot surface files (moepack's or potatomaxx's probe JSON).",
    {
        "convert": LazyCommand(
            "storage",
            "surface_convert_cmd",
            "Rewrite a surface file in the other format (potatomaxx keeps only size, depth, GB/s).",
        ),
        "plot": LazyCommand("storage", "surface_plot_cmd", "Draw a surface file as a heatmap PNG."),
        "show": LazyCommand(
            "storage",
            "surface_show_cmd",
            "Print a surface; with --at, the interpolated bandwidth at those points.",
        ),
    },
)

NPU = CommandGroup(
    "NPU2 packer for Qwen3.6-35B-A3B: .q4nx tiles into the runtime's device buffers, as "
    "versioned layout profiles, with unpack, dump verification and TXN decoding.",
    {
        "inspect": LazyCommand(
            "npu",
            "inspect_cmd",
            "List MODEL's tensors and the profile role each fills (by name, else by a unique "
            "dtype and shape), and which roles are ambiguous or missing.",
        ),
        "map": LazyCommand(
            "npu",
            "map_cmd",
            "Show a profile's buffer map: region, offset, size, tensor, units, order, scheme, "
            "status.",
        ),
        "pack": LazyCommand(
            "npu",
            "pack_cmd",
            "Pack layers of MODEL into per-layer device buffer files and a manifest.",
        ),
        "profiles": LazyCommand(
            "npu", "profiles_cmd", "List the layout profiles and how well each is established."
        ),
        "synth": LazyCommand(
            "npu",
            "synth_cmd",
            "Write a synthetic .q4nx with the 35B's tensor names, dtypes, shapes and valid tiles.",
        ),
        "txn": CommandGroup(
            "NPU2 instruction streams (TXN).",
            {
                "decode": LazyCommand(
                    "npu",
                    "txn_decode_cmd",
                    "Decode a TXN stream (raw, or the .ctrltext section of an ELF): operations, "
                    "buffer descriptors field by field, DMA task-queue writes, scratchpads, "
                    "patch records, and the regions each kernel argument is read or written at.",
                ),
            },
        ),
        "unpack": LazyCommand(
            "npu",
            "unpack_cmd",
            "Rebuild the source tensors of a pack folder as a .q4nx (unretained bytes are zero).",
        ),
        "verify": LazyCommand(
            "npu",
            "verify_cmd",
            "Compare a captured buffer with what a profile produces (exit 1 if it differs).",
        ),
    },
)

COMMANDS: dict[str, Entry] = {
    "advise": LazyCommand(
        "layout",
        "advise_cmd",
        "Ranked recommendations (leave alone, reorder, fuse, expert-major store; queue depth; "
        "cache size), each with its numbers, judged on the trace's second half.",
    ),
    "analyse": LazyCommand(
        "layout",
        "analyse_cmd",
        "Per layer: requests, bytes and read time per token under each layout, the speedup "
        "over the file as it is, and a verdict; with --measure, the reads replayed for real.",
    ),
    "check-dropin": LazyCommand(
        "llama",
        "check_dropin_cmd",
        "Bytes, control, routing and output gates: is CANDIDATE a drop-in for ORIGINAL?",
    ),
    "compare": LazyCommand(
        "quant",
        "compare_cmd",
        "Dequantise the tensors of REFERENCE and CANDIDATE (two GGUFs of one model) and "
        "measure the difference; exit 1 when a tensor fails the thresholds.",
    ),
    "demo": LazyCommand(
        "demo",
        "demo_cmd",
        "Synth -> capture real routing -> plan (scored on held-out prompts) -> repack -> "
        "verify -> llama.cpp judgement, end to end; a synthetic trace without llama.cpp.",
    ),
    "engines": LazyCommand(
        "engines",
        "engines_cmd",
        "List the read engines, which modes PATH's filesystem serves, and the io_uring bindings.",
    ),
    "fit": LazyCommand(
        "fit",
        "fit_cmd",
        "Will MODEL (a GGUF, any shard of a split set, or an http(s) URL read for its header "
        "only) run on this machine, and how fast: what moepack run and serve will choose with "
        "no flags (the engine, the memory budget, the threads), its decode and prefill "
        "tokens/s, what limits it, stock llama.cpp's mmap beside it, the knee, and the same at "
        "two other memory sizes.",
    ),
    "inspect": LazyCommand(
        "inspect",
        "inspect_cmd",
        "Where MODEL's expert bytes sit: per model and per MoE block (any shard of a split file).",
    ),
    "kio": LazyCommand(
        "storage",
        "kio_cmd",
        "Compare read engines and modes on DIRECTORY's device: GB/s, latency, CPU, cache cost.",
    ),
    "npu": NPU,
    "plan": LazyCommand(
        "plan",
        "plan_cmd",
        "Order each MoE block's experts so that experts chosen together sit together.",
    ),
    "predict": LazyCommand(
        "replay",
        "predict_cmd",
        "Recall and precision of each predictor of the next token's experts at a fetch "
        "budget, fitted on the trace's first prompts and scored on whole prompts held out.",
    ),
    "probe": LazyCommand(
        "storage",
        "probe_cmd",
        "Measure the read bandwidth surface (request size × queue depth) of TARGET's device.",
    ),
    "repack": LazyCommand(
        "repack",
        "repack_cmd",
        "Write a drop-in copy of MODEL with experts reordered by a plan and/or laid out anew "
        "(fused gate+up, pipeline order, aligned), or undo such a copy from its provenance.",
    ),
    "replay": LazyCommand(
        "replay",
        "replay_cmd",
        "Replay TRACE's experts through an expert cache, reading every miss for real and cold "
        "from SOURCE (an expert-major store, or a GGUF at a layout's offsets): hit rates, bytes "
        "and time per token, achieved GB/s, the fetch-limited tokens/s, prefetch precision, "
        "peak RSS; --sweep plots cache sizes.",
    ),
    "run": LazyCommand(
        "run",
        "run_cmd",
        "Generate text with llama.cpp after each prompt, in order, and report tokens/s, bytes "
        "read, page faults, expert cache hits and CPU time per token.",
    ),
    "serve": LazyCommand(
        "serve",
        "serve_cmd",
        "Serve MODEL over an OpenAI-compatible API (/v1/chat/completions, /v1/completions, "
        "/v1/models: llama-cpp-python's server) with the optional expert prefetcher, its "
        "measurements at /metrics (Prometheus) and a live dashboard at /; one line per answered "
        "request on stderr. Ctrl-C or SIGTERM stops it within seconds: the generation in "
        "progress ends at its next token and is answered, requests waiting are refused (503); "
        "a second one stops it at once.",
    ),
    "store": STORE,
    "surface": SURFACE,
    "survey": LazyCommand(
        "layout",
        "survey_cmd",
        "From Hugging Face config.json files alone: per-expert slice sizes, and whether layout "
        "can matter on the surface's device.",
    ),
    "synth": LazyCommand(
        "synth",
        "synth_cmd",
        "Write a synthetic MoE checkpoint (qwen3moe, deepseek2, mistral4, qwen2moe, mixtral, "
        "gpt-oss, glm4moe, qwen3next, qwen35moe) that llama.cpp runs, optionally with planted routing, a routing "
        "trace and prompts.",
    ),
    "trace": TRACE,
    "verify": LazyCommand(
        "verify",
        "verify_cmd",
        "Account for every byte of REPACKED against ORIGINAL; exit 1 naming the first difference.",
    ),
}
