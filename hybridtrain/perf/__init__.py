"""Performance tools: checks and measurements that drive the rest of hybridtrain as real processes
(``gpu_check``: the whole GPU path on one machine). May import: engine, reports and everything below;
nothing imports it except ``cli``."""
