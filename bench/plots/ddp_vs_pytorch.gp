# ddp vs PyTorch DDP: gradient synchronisation per step, one cluster of bars per model.
# Input (made by make_plots.sh from compare_pytorch.sh --csv): whitespace-separated columns
#   model  pytorch_ddp  readme_path  contiguous_world  bucketer_mpi  zero_copy_mpi  contiguous_mpi  flat_shm  memcpy
# Usage: gnuplot -e "datafile='sync.dat'; outfile='ddp_vs_pytorch.png'; subtitle='...'" ddp_vs_pytorch.gp
if (!exists("subtitle")) subtitle = ""
set terminal pngcairo size 1100,560 font "sans,10" noenhanced
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
     ''       using 3 title "ddp README path: Bucketer over ddp::world" lc rgb "#08306b", \
     ''       using 4 title "ddp::world, contiguous gradients" lc rgb "#2171b5", \
     ''       using 5 title "Bucketer over MPI" lc rgb "#4292c6", \
     ''       using 6 title "Bucketer over MPI, zero-copy" lc rgb "#6baed6", \
     ''       using 7 title "Bucketer over MPI, contiguous gradients" lc rgb "#9ecae1", \
     ''       using 8 title "flat allreduce: ddp shm" lc rgb "#c6dbef", \
     ''       using 9 title "memcpy of the same bytes" lc rgb "#969696"
