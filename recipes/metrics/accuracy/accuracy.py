# Copyright the hf_moe_offload authors. Apache-2.0.
"""Accuracy as a local `evaluate` metric module.

`evaluate.load("accuracy")` downloads its script from the Hub, which fails offline; this module is the same metric,
loaded by path:

    >>> import evaluate
    >>> accuracy = evaluate.load("recipes/metrics/accuracy")
    >>> accuracy.compute(predictions=[0, 1, 1], references=[0, 1, 0])
    {'accuracy': 0.6666666666666666}
"""

import datasets
import evaluate

_DESCRIPTION = """
Accuracy is the proportion of correct predictions among all predictions:
Accuracy = (TP + TN) / (TP + TN + FP + FN). With `sample_weight`, each prediction counts with its weight.
"""

_KWARGS_DESCRIPTION = """
Args:
    predictions (`list` of `int`): predicted labels.
    references (`list` of `int`): ground-truth labels.
    normalize (`bool`): if False, return the number (or weighted sum) of correct predictions. Defaults to True.
    sample_weight (`list` of `float`): per-prediction weights. Defaults to None (all 1).
Returns:
    accuracy (`float` or `int`): in [0, 1] when normalized, else the count of correct predictions.
Examples:
    >>> accuracy = evaluate.load("recipes/metrics/accuracy")
    >>> accuracy.compute(references=[0, 1, 2, 0, 1, 2], predictions=[0, 1, 1, 2, 1, 0])
    {'accuracy': 0.5}
"""

_CITATION = """
@article{scikit-learn,
  title={Scikit-learn: Machine Learning in {P}ython},
  author={Pedregosa, F. and others},
  journal={Journal of Machine Learning Research},
  volume={12},
  pages={2825--2830},
  year={2011}
}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features(
                {
                    "predictions": datasets.Sequence(datasets.Value("int32")),
                    "references": datasets.Sequence(datasets.Value("int32")),
                }
                if self.config_name == "multilabel"
                else {
                    "predictions": datasets.Value("int32"),
                    "references": datasets.Value("int32"),
                }
            ),
            reference_urls=["https://scikit-learn.org/stable/modules/generated/sklearn.metrics.accuracy_score.html"],
        )

    def _compute(self, predictions, references, normalize=True, sample_weight=None):
        if len(predictions) != len(references):
            raise ValueError(f"got {len(predictions)} predictions for {len(references)} references")
        if self.config_name == "multilabel":
            correct = [float(list(p) == list(r)) for p, r in zip(predictions, references)]
        else:
            correct = [float(int(p) == int(r)) for p, r in zip(predictions, references)]
        weights = [1.0] * len(correct) if sample_weight is None else [float(w) for w in sample_weight]
        total = sum(c * w for c, w in zip(correct, weights))
        if not normalize:
            return {"accuracy": int(total) if float(total).is_integer() else total}
        denom = sum(weights)
        return {"accuracy": float(total / denom) if denom else 0.0}
