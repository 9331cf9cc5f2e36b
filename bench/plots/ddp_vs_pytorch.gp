# ddp vs PyTorch DDP: gradient synchronisation per step, one cluster of bars per model.
# Input (made by make_plots.sh from compare_pytorch.sh --csv): whitespace-separated columns
#   model  pytorch_ddp  ddp_bucketer  ddp_zero_copy  ddp_shm_bucketer  pytorch_flat  ddp_flat  ddp_shm_flat
# Usage: gnuplot -e "datafile='sync.dat'; outfile='ddp_vs_pytorch.png'; subtitle='...'" ddp_vs_pytorch.gp
if (!exists("subtitle")) subtitle = ""
set terminal pngcairo size 1000,540 font "sans,10" noenhanced
set output outfile
set title "Gradient synchronisation per step, 2 ranks (median, lower is better)\n".subtitle
set datafile missing "?"
set style data histograms
set style histogram clustered gap 1.5
set style fill solid 0.85 border -1
set boxwidth 0.9
set ylabel "ms per step"
set yrange [0:*]
set grid ytics
set key top left
set xtics nomirror
plot datafile using 2:xtic(1) title "PyTorch DDP (gloo)" lc rgb "#d62728", \
     ''       using 3 title "ddp Bucketer (MPI)" lc rgb "#08519c", \
     ''       using 4 title "ddp Bucketer, zero-copy (MPI)" lc rgb "#3182bd", \
     ''       using 5 title "ddp Bucketer over shm" lc rgb "#6baed6", \
     ''       using 6 title "flat allreduce: PyTorch gloo" lc rgb "#ff9896", \
     ''       using 7 title "flat allreduce: ddp::mpi" lc rgb "#9ecae1", \
     ''       using 8 title "flat allreduce: ddp shm" lc rgb "#c6dbef"
