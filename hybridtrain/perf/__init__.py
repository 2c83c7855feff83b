"""Performance tools: checks and measurements that drive the rest of hybridtrain as real processes
(``gpu_check``: the whole GPU path on one machine). This subpackage may import anything below it;
nothing imports it except ``cli``."""
