"""A RULER prompt with its values masked and its haystack folded: the form the prompts of RULER's own
generator scripts (fixtures/ruler/prompt_skeletons.json) and ropelab's must share.

Masked: needle keys and values, variable names and values, numbered word lists, coded text. Folded:
the lines of RULER's noise sentence are taken out (the fixture lists the distinct lines taken out, so
the noise is compared too, not where it falls), and a line repeating the line before it (after
masking: needles of a needle haystack, the hops of a variable chain) is dropped.
"""

from __future__ import annotations

import re

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again."
_MASKS = (
    (re.compile(r"One of the special magic (\w+) for .+? is: .+?\.$", re.M), r"One of the special magic \1 for <key> is: <value>."),
    (re.compile(r"special magic (\w+) for .+? mentioned"), r"special magic \1 for <key> mentioned"),
    (re.compile(r"\bVAR [A-Z]+ = VAR [A-Z]+ "), "VAR <name> = VAR <name> "),
    (re.compile(r"\bVAR [A-Z]+ = \d+"), "VAR <name> = <value>"),
    (re.compile(r"assigned the value \d+"), "assigned the value <value>"),
    (re.compile(r"(they are: +)[A-Z]+(?: [A-Z]+)*"), r"\1<names>"),
    (re.compile(r"(?<!\d)1\. [^\n]*"), "<numbered list>"),
    (re.compile(r"(?<= )(?:(?:\.\.\.|[a-z]{6}) )*(?:\.\.\.|[a-z]{6})(?=\n)"), "<coded words>"),
)


def skeleton(prompt: str) -> tuple[str, list[str]]:
    """(the masked and folded prompt, the distinct noise lines taken out of it)."""
    lines = prompt.split("\n")
    taken = sorted({line for line in lines if line == NOISE})
    text = "\n".join(line for line in lines if line != NOISE)
    for pattern, mask in _MASKS:
        text = pattern.sub(mask, text)
    folded: list[str] = []
    for line in text.split("\n"):
        if not folded or line != folded[-1] or not line:
            folded.append(line)
    return "\n".join(folded), taken
