// ddp-trace-merge: merges per-rank traces written by ddp::timeline::recorder into one Chrome
// trace (chrome://tracing, https://ui.perfetto.dev), and optionally a self-contained HTML view.
//
//   ddp-trace-merge -o merged.json [--html view.html] trace.0.json trace.1.json ...
//
// The HTML page (tools/trace_view.html with the trace embedded) draws one group of tracks per
// rank as SVG and needs no network; open it in any browser.
#include <cstdio>
#include <cstring>
#include <exception>
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include <ddp/timeline.hpp>

#include "trace_view_html.hpp"  // generated from tools/trace_view.html

namespace {

int usage() {
  std::fprintf(stderr, "usage: ddp-trace-merge -o OUT.json [--html OUT.html] TRACE.json...\n");
  return 2;
}

// The page with the trace embedded ("</" escaped so the script element cannot end early).
std::string html_page(const std::string& trace) {
  std::string safe;
  safe.reserve(trace.size());
  for (std::size_t i = 0; i < trace.size(); ++i) {
    if (trace[i] == '<' && i + 1 < trace.size() && trace[i + 1] == '/') {
      safe += "<\\/";
      ++i;
    } else {
      safe += trace[i];
    }
  }
  std::string page = ddp_tools::trace_view_html;
  const std::string marker = "/*DDP_TRACE*/null";
  const auto at = page.find(marker);
  if (at == std::string::npos) throw std::runtime_error("trace_view.html lacks the /*DDP_TRACE*/ marker");
  return page.replace(at, marker.size(), safe);
}

}  // namespace

int main(int argc, char** argv) {
  std::string out, html;
  std::vector<std::string> inputs;
  for (int i = 1; i < argc; ++i) {
    if (std::strcmp(argv[i], "-o") == 0 && i + 1 < argc) {
      out = argv[++i];
    } else if (std::strcmp(argv[i], "--html") == 0 && i + 1 < argc) {
      html = argv[++i];
    } else if (argv[i][0] == '-') {
      return usage();
    } else {
      inputs.emplace_back(argv[i]);
    }
  }
  if (out.empty() || inputs.empty()) return usage();
  try {
    ddp::timeline::merge_files(inputs, out);
    if (!html.empty()) {
      std::ifstream in(out, std::ios::binary);
      std::ostringstream merged;
      merged << in.rdbuf();
      std::ofstream f(html, std::ios::binary | std::ios::trunc);
      f << html_page(merged.str());
      if (!f) throw std::runtime_error("cannot write '" + html + "'");
    }
    std::printf("merged %zu trace(s) into %s%s%s\n", inputs.size(), out.c_str(), html.empty() ? "" : " and ",
                html.c_str());
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp-trace-merge: %s\n", e.what());
    return 1;
  }
}
