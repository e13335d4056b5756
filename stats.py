"""Statistics for the evaluation: a 95% interval for an accuracy (Wilson), and for the
difference of two decoders that answered the same prompts (Newcombe's paired interval,
exact McNemar test)."""
import math
import statistics

Z95 = statistics.NormalDist().inv_cdf(0.975)  # 1.96


def wilson(k, n, z=Z95):
    """Wilson score interval for k successes in n trials: unlike p +- z*se it
    stays inside [0, 1] and does not collapse to a point at 0% or 100%."""
    p = k / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return [centre - half, centre + half]


def mcnemar_p(b, c):
    """Exact two-sided McNemar test: b prompts only the first decoder got right,
    c only the second. Under 'equally accurate' each of the b + c discordant
    prompts is a fair coin, so the p-value is a binomial tail."""
    n, k = b + c, min(b, c)
    return min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n)


def newcombe_paired(both, a_only, b_only, neither, z=Z95):
    """95% interval for p_a - p_b from a paired 2x2 table: Newcombe's hybrid score interval for paired
    proportions (Newcombe 1998, Statistics in Medicine 17:2635, method 10; the "square-and-add" interval of
    Fagerland, Lydersen and Laake, Statistical Analysis of Contingency Tables, ch. 8). Each accuracy gets its
    Wilson interval [l, u]; the two distances from the estimates are combined as for a difference, corrected by
    phi, the correlation of the two accuracies over the prompts (shrunk towards 0 when positive). Unlike the
    Wald interval from the discordant pairs it does not collapse to [0, 0] when there are none, and it stays
    inside [-1, 1]."""
    n = both + a_only + b_only + neither
    p1, p2 = (both + a_only) / n, (both + b_only) / n
    (l1, u1), (l2, u2) = wilson(both + a_only, n, z), wilson(both + b_only, n, z)
    margins = (both + a_only) * (b_only + neither) * (both + b_only) * (a_only + neither)
    cross = both * neither - a_only * b_only
    cross = cross - n / 2 if cross > n / 2 else min(cross, 0)
    phi = cross / math.sqrt(margins) if margins else 0.0
    d = p1 - p2
    lo = d - math.sqrt(max((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2, 0))
    hi = d + math.sqrt(max((p2 - l2) ** 2 - 2 * phi * (p2 - l2) * (u1 - p1) + (u1 - p1) ** 2, 0))
    return [lo, hi]


def paired(a, b, z=Z95):
    """Accuracy of a minus accuracy of b (per-prompt 0/1 lists, same prompts):
    the difference, its 95% interval (Newcombe's, `newcombe_paired`), McNemar's p."""
    n = len(a)
    a_only = sum(x > y for x, y in zip(a, b))
    b_only = sum(y > x for x, y in zip(a, b))
    both = sum(x and y for x, y in zip(a, b))
    return {"diff": (a_only - b_only) / n, "ci": newcombe_paired(both, a_only, b_only, n - both - a_only - b_only, z),
            "p_value": mcnemar_p(a_only, b_only), "a_only": a_only, "b_only": b_only, "n": n}
