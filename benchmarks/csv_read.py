"""Reading a CSV input of ``rerankit score`` (``table_files.read_table``): wall time and peak memory of one read.

Makes FILE (if it does not exist) of about ``--mb`` megabytes: an id column, a float column and a column of ~1 KB
documents, with a query column; then reads it once in this process and prints one JSON line: seconds, the process's
peak resident memory (``ru_maxrss``) and the peak of pyarrow's memory pool. Run it in a fresh process per number (the
peaks are the process's); to compare two versions, run each with its own ``PYTHONPATH``:

    PYTHONPATH=src python benchmarks/csv_read.py /tmp/pairs-200mb.csv --mb 200
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import time


def make(path: str, megabytes: int) -> None:
    rng = random.Random(0)
    words = ["clause", "contract", "party", "shall", "term", "notice", "agreement", "the", "of", "and", "ü", "文"]
    target = megabytes * 1_000_000
    with open(path, "w", encoding="utf-8", newline="") as out:
        out.write("id,query,document,prior\n")
        row = 0
        while out.tell() < target:
            document = " ".join(rng.choice(words) for _ in range(150))  # ~1 KB
            out.write(f'{row},q{row % 1000},"{document}, {row}",{rng.randrange(1000, 10 ** 6) / 1000 + 0.0005!r}\n')
            row += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file")
    parser.add_argument("--mb", type=int, default=200, help="the size of the file made where there is none")
    args = parser.parse_args()
    if not os.path.exists(args.file):
        make(args.file, args.mb)
    import pyarrow

    from rerankit.table_files import read_table

    start = time.perf_counter()
    table = read_table(args.file, ["query", "document"])
    seconds = time.perf_counter() - start
    print(json.dumps({"file_mb": round(os.path.getsize(args.file) / 1e6, 1), "rows": table.num_rows,
                      "types": [str(kind) for kind in table.schema.types], "seconds": round(seconds, 3),
                      "peak_rss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
                      "arrow_pool_peak_mb": round(pyarrow.default_memory_pool().max_memory() / 1e6, 1),
                      "table_mb": round(table.nbytes / 1e6, 1)}))


if __name__ == "__main__":
    main()
