"""The GPU acceptance check (``hybridtrain gpu-check``): the project's GPU path on one lent GPU machine, in calls
of a few minutes.

- ``check``: runs the rows as real processes and writes the table after every row;
- ``rows``: the rows, their estimates and the calls they fall in (``--plan``);
- ``probe``: what torch and the node checks say about the GPU, asked in a child process;
- ``bundle``: what the offline machine needs to build Horovod (``make gpu-bundle``);
- ``rehearsal``: every step a call takes before its first GPU step, on a CPU (``--rehearse``);
- ``resume_check``: the resume row's driver (a run stopped and resumed equals one run, bitwise).

May import: perf (a row's precision overrides are bench's, ``perf.bench_sets``), engine and everything below it.
Nothing imports it except cli.
"""
