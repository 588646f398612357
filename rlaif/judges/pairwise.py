"""Position-debiased pairwise preference: both orders asked, averaged."""
from __future__ import annotations


def debiased(judge, prompts, first, second, principle_texts):
    """P(first better) averaged over both orders (position bias removed), each order's value, and whether the two
    orders agree. Swapping first and second gives exactly 1 - p."""
    p_order_ab = judge.prefer_first(prompts, first, second, principle_texts)
    p_order_ba = 1.0 - judge.prefer_first(prompts, second, first, principle_texts)
    p = 0.5 * (p_order_ab + p_order_ba)
    consistent = (p_order_ab > 0.5) == (p_order_ba > 0.5)
    return p, p_order_ab, p_order_ba, consistent

