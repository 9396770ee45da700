"""Where does a step of the tiny example spend its time? (issue 19: the retrieval lanes ran at
~8K tokens/s per process on an H200.) Runs ``examples/pretrain_tiny.py``'s ``main`` in this
process under cProfile and prints the top functions by own time and by cumulative time.

    python benchmarks/profile_tiny.py OUT_PREFIX -- <pretrain_tiny flags>
"""
import cProfile
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import pretrain_tiny  # noqa: E402

if __name__ == "__main__":
    out, flags = sys.argv[1], sys.argv[sys.argv.index("--") + 1:]
    cProfile.run("pretrain_tiny.main(flags)", out + ".prof")
    stats = pstats.Stats(out + ".prof")
    with open(out + ".txt", "w") as f:
        stats.stream = f
        stats.sort_stats("tottime").print_stats(35)
        stats.sort_stats("cumulative").print_stats(60)
    stats.stream = sys.stdout
    stats.sort_stats("tottime").print_stats(20)
