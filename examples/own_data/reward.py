"""The reward of examples/own_data: full credit for the exact sum, partial credit for a close one.

rlframe calls compute_score(data_source, solution_str, ground_truth, extra_info) once per response
(docs/data.md). It returns a dict: "score" is the reward; every other number or boolean is a metric,
logged as reward/<name>/mean (averaged over all samples) and reward/<name>/count.
"""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    answer = solution_str.strip()
    exact = answer == str(ground_truth)
    try:
        off = abs(int(answer) - int(ground_truth))
    except ValueError:  # not a number: no credit, and no "off_by" metric for this sample
        return {"score": 0.0, "exact": False, "is_number": False}
    score = 1.0 if exact else max(0.0, 0.5 - 0.1 * off)  # 0.4 for off by one, 0 from off by 5
    return {"score": score, "exact": exact, "is_number": True, "off_by": float(off)}
