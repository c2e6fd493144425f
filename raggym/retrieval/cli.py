"""The ``raggym index`` and ``raggym retrieve`` subcommands (argparse pieces the main CLI mounts).

    raggym index --corpus corpus.json [--openie openie.json] [--embedder minilm] [--shards S] --out DIR
    raggym retrieve --index DIR --mode passage|graph|hybrid -k K --queries-file FILE --json

``retrieve --json`` prints one JSON object per input line, in input order:
``{"query", "hits": [{"id", "title", "score", "text"}], "seconds", "cost"}`` plus ``"error"`` for a
line that could not be served (empty, too long, not UTF-8); see ``raggym.retrieval.retriever``.

Bad input gives one ``raggym <cmd>: error: ...`` line on stderr and exit status 2, never a traceback.
``python -m raggym.retrieval.cli index|retrieve ...`` runs the same code without the main CLI.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from tqdm.auto import tqdm

from raggym.data import load_corpus

from .base import MODES
from .dense import INDEX_KINDS
from .encoding import PRECISIONS
from .retriever import Retriever, RetrieverConfig


class _CliError(Exception):
    pass


def _fail(cmd: str, message: str) -> int:
    first = " ".join(str(message).split()) or "unknown error"
    print(f"raggym {cmd}: error: {first}", file=sys.stderr)
    return 2


def add_index_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--corpus", required=True, help="corpus file: JSON list of {title, text}, JSONL, or parquet")
    parser.add_argument("--openie", default=None,
                        help="HippoRAG-format OpenIE file (docs[i].extracted_entities / extracted_triples); builds the knowledge graph")
    parser.add_argument("--embedder", default="minilm", help="embedder spec: 'minilm', a local model dir or a cached hub id (default: minilm)")
    parser.add_argument("--shards", type=int, default=1, help="number of dense index shards (default: 1)")
    parser.add_argument("--index-kind", default="flat", choices=INDEX_KINDS, help="dense index: exact 'flat' (default), or ANN 'hnsw'/'ivf'")
    parser.add_argument("--precision", default="fp32", choices=PRECISIONS, help="encoding precision (bf16 = autocast, faster on AMX CPUs)")
    parser.add_argument("--no-cache", action="store_true", help="do not read or write the embedding cache")
    parser.add_argument("--out", required=True, help="index directory to write (replaced atomically)")
    parser.add_argument("--json", action="store_true", help="print a JSON summary")
    parser.add_argument("--quiet", action="store_true", help="no progress bars")
    return parser


def _quiet_model_loading() -> None:
    try:
        # imported here: transformers adds 0.8 s to every `raggym` command's start, --help included
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except Exception:  # noqa: BLE001 - cosmetic only
        pass


def run_index(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    if args.quiet:
        _quiet_model_loading()
    try:
        if args.shards < 1:
            raise _CliError(f"--shards must be at least 1, got {args.shards}")
        corpus = load_corpus(args.corpus)
        if args.shards > len(corpus):
            raise _CliError(f"--shards {args.shards} exceeds the corpus size ({len(corpus)} passages)")
        if args.openie is not None and not Path(args.openie).is_file():
            raise _CliError(f"OpenIE file {args.openie!r} does not exist")
        retriever = Retriever.build(
            corpus,
            embedder=args.embedder,
            openie=args.openie,
            shards=args.shards,
            index=args.index_kind,
            config=RetrieverConfig(precision=args.precision),
            cache=not args.no_cache,
            show_progress=not args.quiet,
        )
        out = retriever.save(args.out)
    except KeyboardInterrupt:
        print("raggym index: interrupted; no index was written", file=sys.stderr)
        return 130
    except (_CliError, ValueError, OSError) as e:  # DataFormatError and ModelSpecError are ValueErrors
        return _fail("index", str(e))
    except Exception as e:  # noqa: BLE001 - an unexpected failure still gets one line, not a traceback
        return _fail("index", f"{type(e).__name__}: {e}")
    summary = {"out": str(out), "seconds": round(time.perf_counter() - started, 3), **retriever.describe()}
    if args.json:
        print(json.dumps(summary))
    else:
        g = summary["graph"]
        graph = f", graph {g['nodes']} nodes / {g['nnz']} nonzeros / {g['facts']} facts" if g else ", no graph"
        print(f"indexed {summary['passages']} passages ({summary['dense']['kind']}, {summary['dense']['shards']} shard(s)){graph} -> {out}")
    return 0


def add_retrieve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    parser.add_argument("--index", required=True, help="index directory written by `raggym index`")
    parser.add_argument("--mode", default="passage", help=f"retrieval mode: {', '.join(MODES)} (default: passage)")
    parser.add_argument("-k", type=int, default=5, help="passages per query (default: 5)")
    parser.add_argument("--queries-file", default=None, help="one query per line ('-' reads stdin)")
    parser.add_argument("--query", action="append", default=None, help="a query (repeatable; instead of --queries-file)")
    parser.add_argument("--batch-size", type=int, default=64, help="queries per batch (default: 64)")
    parser.add_argument("--json", action="store_true", help="one JSON line per query")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def _read_query_lines(path: str) -> list[bytes]:
    try:
        raw = sys.stdin.buffer.read() if path == "-" else Path(path).read_bytes()
    except OSError as e:
        raise _CliError(f"cannot read queries file {path!r} ({e.strerror or e})") from None
    lines = raw.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()  # the newline that ends the last line does not start another query
    return [line[:-1] if line.endswith(b"\r") else line for line in lines]


def run_retrieve(args: argparse.Namespace) -> int:
    _quiet_model_loading()
    try:
        if args.mode not in MODES:
            raise _CliError(f"unknown mode {args.mode!r}; expected one of {', '.join(MODES)}")
        if args.batch_size < 1:
            raise _CliError("--batch-size must be at least 1")
        if (args.queries_file is None) == (args.query is None):
            raise _CliError("give exactly one of --queries-file or --query")
        queries: list = _read_query_lines(args.queries_file) if args.queries_file is not None else list(args.query)
        retriever = Retriever.load(args.index)
        retriever._check_k(args.k)
        if args.mode != "passage" and retriever.graph is None:
            raise _CliError(f"index {args.index!r} has no knowledge graph; rebuild it with --openie to use --mode {args.mode}")
        retriever.warm_up(args.mode)
        bar = tqdm(total=len(queries), desc="retrieving", unit="query", disable=args.quiet or len(queries) < 2 * args.batch_size,
                   file=sys.stderr)
        for start in range(0, len(queries), args.batch_size):
            results = retriever.retrieve(queries[start : start + args.batch_size], mode=args.mode, k=args.k)
            for res in results:
                if args.json:
                    print(json.dumps(res.as_dict(), ensure_ascii=False))
                else:
                    _print_human(res)
            sys.stdout.flush()
            bar.update(len(results))
        bar.close()
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return 0
    except (_CliError, ValueError, OSError) as e:
        return _fail("retrieve", str(e))
    except Exception as e:  # noqa: BLE001
        return _fail("retrieve", f"{type(e).__name__}: {e}")
    return 0


def _print_human(res) -> None:
    print(f"query: {res.query}")
    if res.error:
        print(f"  (no results: {res.error})")
    for rank, hit in enumerate(res.hits, start=1):
        text = " ".join(hit.text.split())
        print(f"  {rank:>2}. {hit.score:.5f}  {hit.title} — {text[:100]}{'…' if len(text) > 100 else ''}")
    print(f"  ({res.seconds * 1000:.1f} ms, cost {res.cost:.0f})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m raggym.retrieval.cli", description="raggym index / retrieve")
    sub = parser.add_subparsers(dest="command", required=True)
    add_index_arguments(sub.add_parser("index", help="build a dense index and knowledge graph"))
    add_retrieve_arguments(sub.add_parser("retrieve", help="query an index"))
    args = parser.parse_args(argv)
    return run_index(args) if args.command == "index" else run_retrieve(args)


if __name__ == "__main__":
    sys.exit(main())
