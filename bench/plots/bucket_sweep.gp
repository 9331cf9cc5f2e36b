# Step time against bucket size: Bucketer<size_capped> over 2 MPI ranks, ResNet-50 shapes.
# Input: the CSV of `ddp_vs_pytorch sweep --csv` (cap_MiB,buckets,median_ms,min_ms,max_ms,n,GB_per_s).
# Usage: gnuplot -e "datafile='sweep.csv'; outfile='bucket_sweep.png'; subtitle='...'" bucket_sweep.gp
if (!exists("subtitle")) subtitle = ""
set terminal pngcairo size 800,480 font "sans,10" noenhanced
set output outfile
set datafile separator ","
set title "Bucketer step time against bucket cap (ResNet-50 shapes, 97.5 MiB, 2 MPI ranks)\n".subtitle
set logscale x 2
set xlabel "bucket cap (MiB)"
set ylabel "ms per step"
set xrange [0.7:150]
set xtics (1, 2, 5, 10, 25, 50, 100)
set yrange [0:*]
set grid
set offsets 0, 0, graph 0.12, 0
set key top right
plot datafile every ::1 using 1:3 with linespoints lc rgb "#1f77b4" pt 7 title "median", \
     ''       every ::1 using 1:4 with linespoints lc rgb "#9ecae1" pt 6 title "fastest iteration", \
     ''       every ::1 using 1:3:(sprintf("%d buckets", $2)) with labels offset 0,1.2 font ",8" notitle
