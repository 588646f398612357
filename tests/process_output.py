"""What a failed subprocess said, for an assertion message: the tail of its stderr, then the lines in it that name
an error. A rank's traceback or native abort sits far above torchrun's report, and a CI log shows only its end."""
import re

ERROR = re.compile(r"Error|error:|Traceback|Fatal Python|terminate called|what\(\)|Segmentation|corrupted|free\(\)")
NOISE = re.compile(r"Warning|warnings\.warn|error_file|ChildFailedError")


def failure(proc, tail: int = 3000) -> str:
    text = proc.stderr if isinstance(proc.stderr, str) else (proc.stderr or b"").decode(errors="replace")
    named = list(dict.fromkeys(line for line in text.splitlines() if ERROR.search(line) and not NOISE.search(line)))
    return f"{text[-tail:]}\n--- lines naming an error ---\n" + "\n".join(named[-20:])
