"""The paper's outputs: its formulas (``paper_metrics``), a run's report (``report``) and the named comparisons
(``experiments``).

May import: engine and everything below it. Nothing imports it except cli, perf and predict.
"""
