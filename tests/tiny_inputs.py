"""The smallest input files of each format the CLI reads, for tests of how it treats its inputs."""

from __future__ import annotations

#: a Muri/Philly trace of one 1-GPU job
MURI_ONE_JOB = "job_id,num_gpu,submit_time,iterations,model_name,batch_size,duration,iteration_time\n0,1,0,10,dqn,128,1000,100\n"
#: an Alibaba v2023 pod list of one half-GPU pod
PODS_ONE = "name,cpu_milli,memory_mib,num_gpu,gpu_milli\np0,1000,1024,1,500\n"

