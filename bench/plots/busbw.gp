# Allreduce bus bandwidth against message size, 2 MPI ranks: ddp::mpi::communicator vs MPI_Allreduce.
# Input: the CSV of `ddp_vs_pytorch busbw --csv`
#   (bytes,ddp_median_us,ddp_busbw_GBps,mpi_median_us,mpi_busbw_GBps,reps), or, with has_nb=1,
#   the same plus a 7th column: MPI_Iallreduce + MPI_Test bus bandwidth (make_plots.sh converts
#   allreduce_bench's CSV to this).
# Usage: gnuplot -e "datafile='busbw.csv'; outfile='busbw.png'; subtitle='...'; has_nb=0" busbw.gp
if (!exists("subtitle")) subtitle = ""
if (!exists("has_nb")) has_nb = 0
set terminal pngcairo size 800,480 font "sans,10" noenhanced
set output outfile
set datafile separator ","
set title "Allreduce bus bandwidth, float32 sum in place, 2 MPI ranks\n".subtitle
set logscale x 2
set xtics ("4" 4, "64" 64, "1K" 1024, "16K" 16384, "256K" 262144, "4M" 4194304, "64M" 67108864, "1G" 1073741824)
set xlabel "message size (bytes)"
set ylabel "bus bandwidth (GB/s) = bytes x 2(n-1)/n / time"
set yrange [0:*]
set grid
set key top left
ddp_curve = 'datafile every ::1 using 1:3 with linespoints lc rgb "#1f77b4" pt 7 title "ddp::mpi::communicator (recursive doubling below 4 KiB, ring from 4 KiB)"'
mpi_curve = 'datafile every ::1 using 1:5 with linespoints lc rgb "#7f7f7f" pt 5 title "MPI_Allreduce (blocking)"'
nb_curve = 'datafile every ::1 using 1:7 with linespoints lc rgb "#bcbd22" pt 9 title "MPI_Iallreduce + MPI_Test"'
if (has_nb) {
  plot @ddp_curve, @mpi_curve, @nb_curve
} else {
  plot @ddp_curve, @mpi_curve
}
