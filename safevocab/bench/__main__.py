"""``python -m safevocab.bench``: the benchmark's report on stdout, its progress lines on stderr.

A worker process (``--_worker``, started by :func:`safevocab.bench.run.run`) runs this too: its report is the
results as one JSON line.
"""

from safevocab.bench.run import run, show_progress

if __name__ == "__main__":  # the `python -m safevocab.bench` entry point (a worker process runs it too)
    show_progress()
    print(run(), flush=True)
